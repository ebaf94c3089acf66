"""The node's processes: containerd, kubelet, kube-proxy, CoreDNS and kube-router's NetworkPolicy
firewall; their certificates,
kubeconfigs and readiness; and loading the project's images into containerd (no registry).

Each process starts through hack.cluster_state.spawn and is recorded in the cluster's state.json
like the control plane's, so `down` stops it by PID (checking it is still our binary).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack.cluster_certs import make_node_pki, write_kubeconfig
from hack.cluster_servers import healthz, kube_request
from hack.cluster_state import (
    SERVICE_CIDR,
    ClusterError,
    State,
    free_port,
    spawn,
    stop,
    wait_until,
)
from hack.node.config import (
    NODE_IP,
    NODE_NAME,
    KubeletFiles,
    NodePaths,
    render_cni_config,
    render_containerd_config,
    render_corefile,
    render_kube_proxy_config,
    render_kubelet_config,
)

CONTAINERD_NAMESPACE = "k8s.io"  # the CRI plugin's namespace: images pods can use live here


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_proxy: Path
    coredns: Path
    kube_router: Path


def _spawn(state: State, name: str, argv: list[str], *, die_with_parent: bool) -> tuple[
        str, subprocess.Popen[bytes]]:
    proc, popen = spawn(name, argv, Path(state.dir) / "logs", die_with_parent=die_with_parent)
    state.procs.append(proc)
    state.save()
    return proc.log, popen


# ------------------------------------------------------------------------------------- containerd


def ctr(paths: NodePaths, *args: str, check: bool = True,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ctr", "--address", str(paths.containerd_socket), "-n",
                           CONTAINERD_NAMESPACE, *args], capture_output=True, text=True,
                          check=check, timeout=timeout)


def start_containerd(state: State, paths: NodePaths, *, sandbox_image: str,
                     die_with_parent: bool) -> None:
    paths.config_dir.mkdir(parents=True, exist_ok=True)
    paths.cni_conf_dir.mkdir(parents=True, exist_ok=True)
    (paths.cni_conf_dir / "10-elastrain.conflist").write_text(
        render_cni_config(paths, service_cidr=SERVICE_CIDR))
    config = paths.config_dir / "containerd.toml"
    config.write_text(render_containerd_config(paths, sandbox_image=sandbox_image))
    log, popen = _spawn(state, "containerd", ["/usr/bin/containerd", "--config", str(config)],
                        die_with_parent=die_with_parent)
    wait_until("containerd", lambda: ctr(paths, "version", check=False, timeout=10)
               .returncode == 0, popen, log, timeout=60)


def image_names(paths: NodePaths) -> set[str]:
    return set(ctr(paths, "images", "ls", "-q").stdout.split())


def normalized(ref: str) -> str:
    """The name containerd's CRI resolves a pod's `image:` to (docker.io/library defaults)."""
    first = ref.split("/")[0]
    if "/" not in ref:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def _remove_orphan_ids(paths: NodePaths) -> None:
    """CRI also names every image it saw by its id (`sha256:<config>`); those names outlive the
    tag and keep an old 5 GB trainer image from the garbage collector (seen: 26 GB of stale
    images in the cached root, and a full disk). Drop the ids no tagged image shares."""
    rows = [line.split() for line in ctr(paths, "images", "ls").stdout.splitlines()[1:]]
    digests = {cols[0]: cols[2] for cols in rows if len(cols) >= 3}
    named = {d for ref, d in digests.items() if not ref.startswith("sha256:")}
    orphans = [ref for ref, d in digests.items() if ref.startswith("sha256:") and d not in named]
    if orphans:
        ctr(paths, "images", "rm", *orphans, check=False)


def import_image(paths: NodePaths, ref: str, archive: Path) -> bool:
    """Imports a docker-archive unless containerd already has `ref`; True when it imported.
    The containerd root is in the cache, so a warm run finds its images there. Other tags of
    the same repository (older builds) are removed first: the trainer image is ~5 GB, and
    containerd's garbage collector frees their blobs and snapshots once nothing names them."""
    names = image_names(paths)
    if normalized(ref) in names:
        return False
    repository = normalized(ref).rpartition(":")[0]
    stale = [n for n in names if n.rpartition(":")[0] == repository]
    if stale:
        ctr(paths, "images", "rm", *stale, check=False)
    _remove_orphan_ids(paths)
    done = ctr(paths, "images", "import", str(archive), check=False)
    if done.returncode != 0 or normalized(ref) not in image_names(paths):
        raise ClusterError(f"importing {archive} as {ref} failed: {done.stderr.strip()}")
    return True


def remove_stale_containers(paths: NodePaths) -> None:
    """Containers a killed session left in the cached containerd root: the kubelet would find
    them as sandboxes of pods that no longer exist."""
    for task in ctr(paths, "tasks", "ls", "-q", check=False).stdout.split():
        ctr(paths, "tasks", "kill", "-s", "SIGKILL", task, check=False)
        ctr(paths, "tasks", "delete", "-f", task, check=False)
    for container in ctr(paths, "containers", "ls", "-q", check=False).stdout.split():
        ctr(paths, "containers", "delete", container, check=False)


# ----------------------------------------------------------------------------------------- kubelet


def make_node_certificates(state: State) -> None:
    """Before the apiserver starts: it loads its kubelet client certificate at start."""
    make_node_pki(Path(state.dir) / "pki", node_name=NODE_NAME, node_ip=NODE_IP)


def write_node_kubeconfigs(state: State) -> dict[str, Path]:
    """Kubeconfigs of the kubelet and kube-proxy (CoreDNS reads with the admin's)."""
    pki = Path(state.dir) / "pki"
    out = {}
    for user in ("kubelet", "kube-proxy"):
        out[user] = Path(state.dir) / f"{user}.kubeconfig"
        write_kubeconfig(out[user], state.server, pki, user)
    return out


def start_kubelet(state: State, paths: NodePaths, binaries: NodeBinaries, kubeconfig: Path, *,
                  die_with_parent: bool) -> None:
    pki = Path(state.dir) / "pki"
    resolv = paths.config_dir / "resolv.conf"
    # Pods resolve through clusterDNS only; the host's resolvers are not theirs to use.
    resolv.write_text("# elastrain real node: pods use clusterDNS only\n")
    files = KubeletFiles(ca=pki / "ca.crt", serving_cert=pki / "kubelet-serving.crt",
                         serving_key=pki / "kubelet-serving.key", resolv_conf=resolv)
    healthz_port = free_port()
    config = paths.config_dir / "kubelet.json"
    config.write_text(render_kubelet_config(files, healthz_port=healthz_port))
    paths.kubelet_root.mkdir(parents=True, exist_ok=True)
    argv = [str(binaries.kubelet), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}",
            f"--root-dir={paths.kubelet_root}",
            f"--container-runtime-endpoint=unix://{paths.containerd_socket}", "--v=1"]
    log, popen = _spawn(state, "kubelet", argv, die_with_parent=die_with_parent)
    wait_until("kubelet healthz", lambda: healthz(f"http://127.0.0.1:{healthz_port}/healthz"),
               popen, log, timeout=60)
    wait_until("node Ready", lambda: node_ready(state), popen, log, timeout=90)


def node_ready(state: State, name: str = NODE_NAME) -> bool:
    """Ready, and without the not-ready taint every new Node starts with (the node-lifecycle
    controller lifts it once the kubelet reports Ready; pitfall 3)."""
    status, node = kube_request(state, "GET", f"/api/v1/nodes/{name}")
    if status != 200:
        return False
    doc: dict[str, Any] = node
    conditions = doc.get("status", {}).get("conditions", [])
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    taints = doc.get("spec", {}).get("taints") or []
    return ready and not any(t["key"] == "node.kubernetes.io/not-ready" for t in taints)


# ------------------------------------------------------------------------------ kube-proxy, DNS


def start_kube_proxy(state: State, paths: NodePaths, binaries: NodeBinaries, kubeconfig: Path, *,
                     die_with_parent: bool) -> None:
    healthz_port, metrics = free_port(), free_port()
    config = paths.config_dir / "kube-proxy.json"
    config.write_text(render_kube_proxy_config(kubeconfig, healthz_port=healthz_port,
                                               metrics_port=metrics))
    log, popen = _spawn(state, "kube-proxy", [str(binaries.kube_proxy), f"--config={config}",
                                              "--v=1"], die_with_parent=die_with_parent)
    wait_until("kube-proxy", lambda: healthz(f"http://127.0.0.1:{healthz_port}/healthz"),
               popen, log, timeout=60)


def start_coredns(state: State, paths: NodePaths, binaries: NodeBinaries, *,
                  die_with_parent: bool) -> None:
    health, ready = free_port(), free_port()
    corefile = paths.config_dir / "Corefile"
    corefile.write_text(render_corefile(Path(state.kubeconfig), health_port=health,
                                        ready_port=ready))
    log, popen = _spawn(state, "coredns", [str(binaries.coredns), "-conf", str(corefile)],
                        die_with_parent=die_with_parent)
    wait_until("CoreDNS", lambda: healthz(f"http://127.0.0.1:{ready}/ready"), popen, log,
               timeout=60)


# ------------------------------------------------------------------------ NetworkPolicy enforcer


def start_kube_router(state: State, binaries: NodeBinaries, *, die_with_parent: bool) -> None:
    """kube-router with only its NetworkPolicy firewall controller: pod networking stays the CNI
    bridge's and Services stay kube-proxy's. Why kube-router: it enforces NetworkPolicy with
    iptables and ipsets on whatever bridge the pods use, as one Go binary built from the module
    proxy (hack/build-kube-router.sh); Calico and Cilium want their own CNI plugin and dataplane
    (Cilium: eBPF and a kernel toolchain), kube-network-policies (sigs.k8s.io) needs nfqueue
    and is younger. It reads pods, namespaces and NetworkPolicies with the admin's kubeconfig
    (as CoreDNS does), filters bridged traffic (br_netfilter: host.enable_bridge_netfilter) and
    accepts what comes from the node itself, so kubelet probes pass (render.network says so).
    Its chains (KUBE-ROUTER-*, KUBE-POD-FW-*, KUBE-NWPLCY-*) go with the KUBE-* ones at
    teardown, its ipsets after them (host.remove_ipsets)."""
    health = free_port()
    argv = [str(binaries.kube_router), "--run-firewall=true", "--run-router=false",
            "--run-service-proxy=false", f"--kubeconfig={state.kubeconfig}",
            f"--hostname-override={NODE_NAME}", f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--health-port={health}", "--metrics-port=0", "--v=1"]
    log, popen = _spawn(state, "kube-router", argv, die_with_parent=die_with_parent)
    wait_until("kube-router", lambda: healthz(f"http://127.0.0.1:{health}/healthz"), popen, log,
               timeout=90)


# --------------------------------------------------------------------------------------- teardown


def delete_all_pods(state: State) -> None:
    """Deletes every pod while the kubelet still runs, so it stops containers and tears down their
    networks through CNI (note, pitfall 9)."""
    status, namespaces = kube_request(state, "GET", "/api/v1/namespaces")
    if status != 200:
        return
    items: list[dict[str, Any]] = namespaces.get("items", [])  # type: ignore[assignment]
    for item in items:
        ns = item["metadata"]["name"]
        kube_request(state, "DELETE", f"/api/v1/namespaces/{ns}/pods",
                     {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})


def wait_for_no_tasks(paths: NodePaths, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = ctr(paths, "tasks", "ls", "-q", check=False, timeout=10)
        if done.returncode != 0 or not done.stdout.split():
            return
        time.sleep(0.5)


def stop_named(state: State, *names: str) -> None:
    for name in names:
        for proc in [p for p in state.procs if p.name == name]:
            stop(proc)
            state.procs.remove(proc)
    state.save()


def kill_leftover_shims(paths: NodePaths) -> None:
    """containerd-shim-runc-v2 processes of our containerd outlive it by design; kill them."""
    needle = str(paths.containerd_socket).encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in args and needle in args:
            subprocess.run(["kill", "-9", cmdline.parent.name], check=False)
