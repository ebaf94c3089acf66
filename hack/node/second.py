"""Node 2: a second real node joined on demand to a running real-node cluster (tier node), its
processes run in its own namespaces (hack/node/namespaces.py), and the fault knobs a test calls.

    up_second(state, binaries, cache=..., images=..., die_with_parent=...)
    down_second(state)        # pods deleted, processes stopped, Node deleted, host cleaned
    stop_runtime(state)       # kubelet + containerd stopped; containers keep running (shims)
    start_runtime(state)      # both started again with the same configs, node Ready again
    partition() / heal()      # every packet to and from node 2 dropped / let through again

Its processes are recorded in <cluster dir>/node2/record.json, apart from state.json: a test
stopping node 2's kubelet must not make the cluster look dead to `State.running()`, and node 1's
`down` finds the record and takes node 2 down first. The caller holds host.node_lock() for up
and down. Standard library only, like the rest of hack/.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hack.cluster_certs import make_kubelet_pki, write_kubeconfig
from hack.cluster_servers import healthz, kube_request
from hack.cluster_state import (
    SERVICE_CIDR,
    ClusterError,
    Proc,
    State,
    free_port,
    spawn,
    stop,
    wait_until,
)
from hack.node import namespaces
from hack.node.config import (
    KubeletFiles,
    NodePaths,
    render_cni_config,
    render_containerd_config,
    render_kube_proxy_config,
    render_kubelet_config,
)
from hack.node.second_config import NAME, NODE_IP, PRIVATE_DIRS, RUN_DIR, SECOND, nsenter
from hack.node.servers import (
    NodeBinaries,
    ctr,
    import_image,
    node_ready,
    remove_stale_containers,
    wait_for_no_tasks,
)

CONFIG_NAME = "node2"  # its config dir, record and logs in the cluster dir
PKI_PREFIX = "kubelet-node2"

partition = namespaces.partition
heal = namespaces.heal
is_partitioned = namespaces.is_partitioned


@dataclass
class Record:
    """What node 2 runs and what its teardown restores."""

    dir: str
    procs: list[Proc] = field(default_factory=list)
    health: dict[str, str] = field(default_factory=dict)  # process name -> healthz URL
    created_dirs: list[str] = field(default_factory=list)
    die_with_parent: bool = False

    @staticmethod
    def path_for(state: State) -> Path:
        return Path(state.dir) / CONFIG_NAME / "record.json"

    def save(self) -> None:
        path = Path(self.dir) / CONFIG_NAME / "record.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, state: State) -> Record | None:
        try:
            raw = json.loads(cls.path_for(state).read_text())
        except (OSError, ValueError):
            return None
        raw["procs"] = [Proc(**p) for p in raw.get("procs", [])]
        return cls(**raw)


def second_paths(state: State, cache: Path) -> NodePaths:
    return NodePaths(cluster_dir=Path(state.dir), containerd_root=cache / "containerd-node2",
                     run_dir=RUN_DIR, config_name=CONFIG_NAME)


def is_up(state: State) -> bool:
    return Record.load(state) is not None


# ------------------------------------------------------------------------------------- processes


def _spawn(state: State, record: Record, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    """`argv` started inside node 2's namespaces. The record keeps the program's own argv (not
    nsenter's), which its PID shows once nsenter has exec'd it: `Proc.alive` compares them."""
    proc, popen = spawn(name, nsenter(*argv), Path(state.dir) / "logs" / CONFIG_NAME,
                        die_with_parent=record.die_with_parent)
    proc.argv = argv
    record.procs = [p for p in record.procs if p.name != name] + [proc]
    record.save()
    wait_until(f"node 2's {name} exec", proc.alive, popen, proc.log, timeout=10)
    return popen


def _start(state: State, record: Record, name: str, argv: list[str], *,
           timeout: float = 60) -> None:
    popen = _spawn(state, record, name, argv)
    proc = next(p for p in record.procs if p.name == name)
    url = record.health[name]
    wait_until(f"node 2's {name}", lambda: _answers(state, url), popen, proc.log,
               timeout=timeout)
    if name == "kubelet":
        wait_until("node 2 Ready", lambda: node_ready(state, NAME), popen, proc.log,
                   timeout=90)


def _answers(state: State, url: str) -> bool:
    """containerd answers on its socket (unix://), the others on their healthz URL, which
    listens on node 2's IP: its loopback is not the host's."""
    if not url.startswith("unix://"):
        return healthz(url)
    paths = NodePaths(cluster_dir=Path(state.dir), containerd_root=Path("/"), run_dir=RUN_DIR)
    return ctr(paths, "version", check=False, timeout=10).returncode == 0


def _credentials(state: State) -> dict[str, Path]:
    """Node 2's kubelet certificates (system:node:<NAME>, its IP as SAN) beside node 1's in the
    cluster's CA dir, and kubeconfigs; kube-proxy shares node 1's identity. Made anew each time:
    a cluster dir reused by a later `up` has a new CA, and old ones would be Unauthorized."""
    pki = Path(state.dir) / "pki"
    make_kubelet_pki(pki, node_name=NAME, node_ip=NODE_IP, prefix=PKI_PREFIX)
    out = {}
    for key, user in (("kubelet", PKI_PREFIX), ("kube-proxy", "kube-proxy")):
        out[key] = Path(state.dir) / CONFIG_NAME / f"{key}.kubeconfig"
        write_kubeconfig(out[key], state.server, pki, user)
    return out


def _write_configs(state: State, paths: NodePaths, binaries: NodeBinaries, *,
                   sandbox_image: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Config files; each process's argv (argv.json keeps them for the restart knob) and the
    URL that says it is ready."""
    pki, cfg = Path(state.dir) / "pki", paths.config_dir
    credentials = _credentials(state)
    paths.cni_conf_dir.mkdir(parents=True, exist_ok=True)
    (paths.cni_conf_dir / "10-elastrain.conflist").write_text(
        render_cni_config(paths, service_cidr=SERVICE_CIDR, node=SECOND))
    (cfg / "containerd.toml").write_text(render_containerd_config(paths,
                                                                  sandbox_image=sandbox_image))
    resolv = cfg / "resolv.conf"
    resolv.write_text("# elastrain node 2: pods use clusterDNS only\n")
    files = KubeletFiles(ca=pki / "ca.crt", serving_cert=pki / f"{PKI_PREFIX}-serving.crt",
                         serving_key=pki / f"{PKI_PREFIX}-serving.key", resolv_conf=resolv)
    kubelet_port, proxy_port, router_port = free_port(), free_port(), free_port()
    (cfg / "kubelet.json").write_text(render_kubelet_config(files, healthz_port=kubelet_port,
                                                            node=SECOND))
    (cfg / "kube-proxy.json").write_text(render_kube_proxy_config(
        credentials["kube-proxy"], healthz_port=proxy_port, metrics_port=free_port(),
        node=SECOND))
    paths.kubelet_root.mkdir(parents=True, exist_ok=True)
    argvs = {
        "containerd": ["/usr/bin/containerd", "--config", str(cfg / "containerd.toml")],
        "kubelet": [str(binaries.kubelet), f"--config={cfg / 'kubelet.json'}",
                    f"--kubeconfig={credentials['kubelet']}", f"--hostname-override={NAME}",
                    f"--node-ip={NODE_IP}", f"--root-dir={paths.kubelet_root}",
                    f"--container-runtime-endpoint=unix://{paths.containerd_socket}", "--v=1"],
        "kube-proxy": [str(binaries.kube_proxy), f"--config={cfg / 'kube-proxy.json'}",
                       "--v=1"],
        # As node 1's (servers.start_kube_router): NetworkPolicy only, for node 2's pods.
        "kube-router": [str(binaries.kube_router), "--run-firewall=true", "--run-router=false",
                        "--run-service-proxy=false", f"--kubeconfig={state.kubeconfig}",
                        f"--hostname-override={NAME}",
                        f"--service-cluster-ip-range={SERVICE_CIDR}",
                        f"--health-port={router_port}", "--metrics-port=0", "--v=1"],
    }
    health = {"containerd": f"unix://{paths.containerd_socket}",
              "kubelet": f"http://{NODE_IP}:{kubelet_port}/healthz",
              "kube-proxy": f"http://{NODE_IP}:{proxy_port}/healthz",
              "kube-router": f"http://{NODE_IP}:{router_port}/healthz"}
    (cfg / "argv.json").write_text(json.dumps(argvs, indent=2) + "\n")
    return argvs, health


# ------------------------------------------------------------------------------------ up and down


def up_second(state: State, binaries: NodeBinaries, *, cache: Path,
              images: Mapping[str, tuple[str, Path]], die_with_parent: bool) -> None:
    """Node 2 joined to the running node-1 cluster of `state`, Ready and untainted, with
    `images` (name -> (ref, docker-archive); "pause" is the sandbox image) in its containerd."""
    if not state.node or not state.server:
        raise ClusterError("node 2 joins a running real-node cluster (tier node)")
    if "pause" not in images:
        raise ClusterError("node 2 needs the pause image")
    if Record.load(state) is not None:
        down_second(state)  # a killed session's
    elif RUN_DIR.exists():  # a node 2 whose record went with its cluster dir: node 1 is ours
        namespaces.cleanup(created_dirs=[])
    record = Record(dir=state.dir, die_with_parent=die_with_parent,
                    created_dirs=[str(d) for d in PRIVATE_DIRS if not d.exists()])
    record.save()
    try:
        namespaces.create_namespaces()
        namespaces.create_network()
        namespaces.create_cgroup_root()
        paths = second_paths(state, cache)
        argvs, record.health = _write_configs(state, paths, binaries,
                                              sandbox_image=images["pause"][0])
        record.save()
        _start(state, record, "containerd", argvs["containerd"])
        remove_stale_containers(paths)
        for ref, archive in images.values():
            import_image(paths, ref, archive)
        for name in ("kubelet", "kube-proxy", "kube-router"):
            _start(state, record, name, argvs[name], timeout=90)
    except BaseException:
        down_second(state)
        raise


def _argvs(state: State) -> dict[str, list[str]]:
    argvs: dict[str, list[str]] = json.loads(
        (Path(state.dir) / CONFIG_NAME / "argv.json").read_text())
    return argvs


def _stop(record: Record, *names: str) -> None:
    for name in names:
        for proc in [p for p in record.procs if p.name == name]:
            stop(proc)
            record.procs.remove(proc)
    record.save()


def stop_runtime(state: State) -> None:
    """The fault knob: node 2's kubelet and containerd stopped (SIGTERM). Its containers keep
    running: their shims outlive containerd by design. Its Node goes NotReady once the
    node-lifecycle controller's grace period (kube-controller-manager's default, 50 s) passes."""
    record = _record(state)
    _stop(record, "kubelet", "containerd")


# containerd answers on its socket before its CRI service is initialized; a kubelet started in
# that window fails its CRI check and exits (seen in two e2e runs: node 2 then stayed NotReady).
CRI_NOT_READY = "server is not initialized yet"
KUBELET_STARTS = 5


def start_runtime(state: State) -> None:
    """containerd and the kubelet started again with their configs; returns once node 2 is
    Ready (the running containers are found again through their shims). A kubelet that exits
    because containerd's CRI is not initialized yet is started again, a few times."""
    record, argvs = _record(state), _argvs(state)
    for name in ("containerd", "kubelet"):
        for attempt in range(1, KUBELET_STARTS + 1):
            if any(p.name == name and p.alive() for p in record.procs):
                break
            try:
                _start(state, record, name, argvs[name], timeout=90)
            except ClusterError as e:
                if CRI_NOT_READY not in str(e) or attempt == KUBELET_STARTS:
                    raise
                time.sleep(1.0)


def _record(state: State) -> Record:
    record = Record.load(state)
    if record is None:
        raise ClusterError(f"no node 2 in {state.dir}")
    return record


def down_second(state: State, *, cache: Path | None = None) -> None:
    """Pods on node 2 deleted while its kubelet runs (it stops their containers and tears down
    their networks), its processes stopped, its Node deleted, then the host cleaned."""
    record = Record.load(state)
    if record is None:
        return
    paths = NodePaths(cluster_dir=Path(state.dir), containerd_root=cache or Path("/"),
                      run_dir=RUN_DIR, config_name=CONFIG_NAME)
    kubelet_up = any(p.name == "kubelet" and p.alive() for p in record.procs)
    if heal_if_partitioned() and kubelet_up:
        time.sleep(1)  # the kubelet's watch reconnects before its pods are deleted
    if kubelet_up and state.server:
        _delete_pods(state)
        wait_for_no_tasks(paths)
    _stop(record, "kube-router", "kube-proxy", "kubelet")
    if any(p.name == "containerd" and p.alive() for p in record.procs):
        remove_stale_containers(paths)
    _stop(record, "containerd")
    if state.server:
        _api(state, "DELETE", f"/api/v1/nodes/{NAME}")
    namespaces.cleanup(created_dirs=record.created_dirs)
    Record.path_for(state).unlink(missing_ok=True)


def heal_if_partitioned() -> bool:
    if namespaces.is_partitioned():
        heal()
        return True
    return False


def _api(state: State, method: str, path: str, body: object = None) -> tuple[int, Any]:
    try:
        return kube_request(state, method, path, body)
    except OSError:  # the apiserver already stopped
        return 0, {}


def _delete_pods(state: State) -> None:
    status, pods = _api(state, "GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{NAME}")
    if status != 200:
        return
    for pod in pods.get("items", []):
        meta = pod["metadata"]
        _api(state, "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
             {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})
