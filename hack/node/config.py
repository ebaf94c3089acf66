"""The node's fixed addresses and paths, and pure renderers of its config files.

Everything here is a function of its arguments (no I/O), so tests/unit/harness checks the
settings the note's pitfalls depend on without starting anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

NODE_NAME = "elastrain-node"
BRIDGE = "elastrain0"
# Not 10.88.0.0/16 (podman's and containerd's example default): nothing else may own this bridge.
POD_CIDR = "10.244.0.0/24"
NODE_IP = "10.244.0.1"  # the bridge's address: node IP, kubelet, apiserver, CoreDNS, MinIO
POD_RANGE_START = "10.244.0.10"
CLUSTER_DOMAIN = "cluster.local"
KUBELET_PORT = 10250
# Machine-wide, because one node per machine: the bridge, :10250, /kubepods and iptables chains
# are global (note, pitfall 11).
RUN_DIR = Path("/run/elastrain-node")
LOCK_FILE = Path("/run/lock/elastrain-node.lock")
OWNER_FILE = RUN_DIR / "owner.json"
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
FIREWALL_CHAIN = "ELASTRAIN-NODE"
# Paths the node's parts write whatever we configure: containerd 1.6's shim and runc dirs, the
# CRI's pod network namespaces, CNI's result cache, the kubelet's pod logs. Node 1 removes those
# it created (host.cleanup_host); node 2 mounts private ones over them (second_config).
FIXED_HOST_DIRS = (Path("/run/containerd"), Path("/run/netns"), Path("/var/lib/cni"),
                   Path("/var/log/pods"))
# Every node's pod CIDR lies in it: a pod routes it through its node, so pods reach pods (and
# node addresses) on the other node. Without a second node the host has no route for the rest
# of it, and the firewall chain drops what would leave by the default route.
CLUSTER_POD_CIDR = "10.244.0.0/16"


@dataclass(frozen=True)
class NodeNet:
    """One node's name and addresses. `probe_address` is where its health endpoints listen: a
    node in its own network namespace cannot be probed on its loopback from the host."""

    name: str
    bridge: str
    ip: str  # the bridge's address, its node IP
    pod_cidr: str
    range_start: str
    probe_address: str = "127.0.0.1"
    cgroup_root: str = ""  # the kubelet's cgroupRoot; "" keeps its default, /


FIRST = NodeNet(name=NODE_NAME, bridge=BRIDGE, ip=NODE_IP, pod_cidr=POD_CIDR,
                range_start=POD_RANGE_START)


@dataclass(frozen=True)
class NodePaths:
    """Where one node keeps its files: config and logs in the cluster dir, runtime state under
    RUN_DIR, and containerd's content store in the cache so imported images survive a restart."""

    cluster_dir: Path
    containerd_root: Path
    run_dir: Path = RUN_DIR
    config_name: str = "node"  # the config dir's name in the cluster dir

    @property
    def config_dir(self) -> Path:
        return self.cluster_dir / self.config_name

    @property
    def containerd_state(self) -> Path:
        return self.run_dir / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.run_dir / "kubelet"

    @property
    def cni_conf_dir(self) -> Path:
        return self.config_dir / "cni"

    @property
    def cni_data_dir(self) -> Path:
        return self.run_dir / "cni-ipam"


def render_containerd_config(paths: NodePaths, *, sandbox_image: str) -> str:
    """containerd 1.6 (config version 2) with the CRI plugin set up for this VM."""
    return f"""version = 2
root = "{paths.containerd_root}"
state = "{paths.containerd_state}"

[grpc]
  address = "{paths.containerd_socket}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  # This VM lacks CAP_SYS_RESOURCE: an oom_score_adj below the current one (the kubelet asks -998
  # for sandboxes) makes every runc create fail (note, pitfall 1).
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{paths.cni_conf_dir}"
    max_conf_num = 1
"""


def render_cni_config(paths: NodePaths, *, service_cidr: str, node: NodeNet = FIRST) -> str:
    """A bridge network that keeps pod traffic on this machine: no ipMasq and no default route in
    pods, only routes to the Service range and to every node's pods through the bridge (note,
    pitfall 6)."""
    conf = {
        "cniVersion": "1.0.0",
        "name": "elastrain",
        "plugins": [
            {
                "type": "bridge", "bridge": node.bridge, "isGateway": True,
                "isDefaultGateway": False, "ipMasq": False,
                # A pod reaching itself through a Service needs the frame sent back out its port.
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local", "dataDir": str(paths.cni_data_dir),
                    "ranges": [[{"subnet": node.pod_cidr, "rangeStart": node.range_start,
                                 "gateway": node.ip}]],
                    "routes": [{"dst": service_cidr}, {"dst": CLUSTER_POD_CIDR}],
                },
            },
            {"type": "loopback"},
        ],
    }
    return json.dumps(conf, indent=2) + "\n"


@dataclass(frozen=True)
class KubeletFiles:
    """What the kubelet config points at."""

    ca: Path
    serving_cert: Path
    serving_key: Path
    resolv_conf: Path


def render_kubelet_config(files: KubeletFiles, *, healthz_port: int,
                          node: NodeNet = FIRST) -> str:
    """KubeletConfiguration (JSON is YAML) with the settings that worked here (note, pitfall 12).
    Cluster DNS is node 1's CoreDNS on every node."""
    config: dict[str, object] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.ip,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": node.probe_address,
        "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(files.ca)}},
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(files.serving_cert),
        "tlsPrivateKeyFile": str(files.serving_key),
        # No systemd here; containerd 1.6 reports no cgroup driver, so say it (pitfall 10).
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "failCgroupV1": False,
        "clusterDNS": [NODE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(files.resolv_conf),
        # Builds fill the page cache and the disk: evict only when the machine is really out.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        # There is no registry to pull an image back from: never collect images.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "makeIPTablesUtilChains": False,
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "registerNode": True,
        "maxPods": 110,
        # Renewed every quarter of it (3 s): well inside the controller-manager's 20 s
        # node-monitor-grace-period here (hack/cluster_servers.py).
        "nodeLeaseDurationSeconds": 12,
    }
    if node.cgroup_root:
        # Its own cgroup tree: /kubepods is node 1's in every hierarchy (pitfall 11).
        config["cgroupRoot"] = node.cgroup_root
    return json.dumps(config, indent=2) + "\n"


def render_kube_proxy_config(kubeconfig: Path, *, healthz_port: int, metrics_port: int,
                             node: NodeNet = FIRST) -> str:
    """iptables mode, NodePorts only on the bridge address, and conntrack left alone: setting its
    sysctls would change the host for everyone (note, pitfall 8)."""
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node.name,
        "mode": "iptables",
        "clusterCIDR": node.pod_cidr,
        "bindAddress": node.ip,
        "healthzBindAddress": f"{node.probe_address}:{healthz_port}",
        "metricsBindAddress": f"{node.probe_address}:{metrics_port}",
        "nodePortAddresses": [f"{node.ip}/32"],
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        "iptables": {"syncPeriod": "30s", "minSyncPeriod": "0s"},
    }
    return json.dumps(config, indent=2) + "\n"


def render_corefile(kubeconfig: Path, *, health_port: int, ready_port: int) -> str:
    """Cluster DNS on the bridge address. No `forward`: pods resolve cluster names only, so
    nothing they look up leaves the machine (note, pitfall 7)."""
    return f""".:53 {{
    bind {NODE_IP}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} elastrain
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""
