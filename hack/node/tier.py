"""`up_node` and `down_node`: the real node joined to the control plane hack/cluster.py starts.

Order up: lock -> packages -> bridge (everything pods reach binds its address) -> control plane
on the bridge address -> containerd -> images -> kubelet (Ready, untainted) -> kube-proxy ->
CoreDNS -> kube-router (NetworkPolicy) -> MinIO. Down, the reverse, with pods deleted while the
kubelet still runs, then the host cleaned (hack/node/host.py says what that restores); a second
node (hack/node/second.py), when one was added, goes first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from hack.cluster_state import ClusterError, State
from hack.node import host
from hack.node.config import FIXED_HOST_DIRS, NODE_IP, NodePaths
from hack.node.second import down_second
from hack.node.servers import (
    NodeBinaries,
    delete_all_pods,
    import_image,
    kill_leftover_shims,
    remove_stale_containers,
    start_containerd,
    start_coredns,
    start_kube_proxy,
    start_kube_router,
    start_kubelet,
    stop_named,
    wait_for_no_tasks,
    write_node_kubeconfigs,
)

NODE_PROCS = ("kube-router", "coredns", "kube-proxy", "kubelet", "containerd")


def node_paths(state: State, cache: Path) -> NodePaths:
    return NodePaths(cluster_dir=Path(state.dir), containerd_root=cache / "containerd")


def prepare_host(state: State) -> None:
    """Before the control plane: refuse a second node, take over a dead one's leftovers, make the
    bridge the apiserver binds, and record what teardown restores."""
    host.check_privileges()
    owner = host.read_owner()
    if owner is not None and owner.get("dir") != state.dir:
        other = Path(str(owner["dir"]))
        other_state = State.load(other)
        if other_state is not None and any(p.alive() for p in other_state.procs
                                           if p.name in NODE_PROCS):
            raise ClusterError(f"a real node already runs on this machine (cluster dir {other});"
                               f" stop it with: python3 hack/cluster.py down --dir {other}")
        if other_state is not None:
            down_node(other_state)
    host.install_packages()
    state.node = {"ip_forward_before": state.node.get("ip_forward_before")
                  or host.read_ip_forward(),
                  "bridge_nf_before": state.node.get("bridge_nf_before")
                  or host.read_bridge_netfilter(),
                  "created_dirs": state.node.get("created_dirs")
                  or [str(d) for d in FIXED_HOST_DIRS if not d.exists()]}
    state.save()
    host.write_owner(Path(state.dir), {})
    host.create_bridge()
    host.install_firewall()
    host.install_service_rule()
    # Services (pod -> ClusterIP -> pod) are routed by the host (pitfall 8).
    host.write_ip_forward("1")
    # Pod-to-pod frames on the bridge pass iptables, where kube-router enforces NetworkPolicy.
    host.write_bridge_netfilter("1")


def start_node(state: State, binaries: NodeBinaries, *, cache: Path,
               images: Mapping[str, tuple[str, Path]], die_with_parent: bool) -> None:
    """After the control plane: containerd with the images loaded, kubelet, kube-proxy, CoreDNS,
    kube-router's firewall.
    `images`: name -> (ref, docker-archive); "pause" is the sandbox image."""
    if "pause" not in images:
        raise ClusterError("the real node needs the pause image")
    paths = node_paths(state, cache)
    credentials = write_node_kubeconfigs(state)
    start_containerd(state, paths, sandbox_image=images["pause"][0],
                     die_with_parent=die_with_parent)
    remove_stale_containers(paths)
    load_images(state, images, cache=cache)
    start_kubelet(state, paths, binaries, credentials["kubelet"], die_with_parent=die_with_parent)
    start_kube_proxy(state, paths, binaries, credentials["kube-proxy"],
                     die_with_parent=die_with_parent)
    start_coredns(state, paths, binaries, die_with_parent=die_with_parent)
    start_kube_router(state, binaries, die_with_parent=die_with_parent)
    state.node["node_ip"] = NODE_IP
    state.node["containerd_socket"] = str(paths.containerd_socket)
    state.save()
    host.write_owner(Path(state.dir), {p.name: p.pid for p in state.procs})


def load_images(state: State, images: Mapping[str, tuple[str, Path]], *, cache: Path) -> None:
    """Imports each (ref, docker-archive) the node's containerd lacks; also into a running node
    (the e2e fixture reusing a cluster after an image was rebuilt)."""
    paths = node_paths(state, cache)
    for ref, archive in images.values():
        import_image(paths, ref, archive)


def down_node(state: State, *, stop_control_plane: Callable[[], None] | None = None) -> None:
    """Stops the node's processes in order, then the control plane, then cleans the host.
    The caller holds host.node_lock()."""
    if not state.node:
        return
    cache = Path(os.environ.get("ELASTRAIN_CACHE", Path.home() / ".cache" / "elastrain"))
    # Node 2 (hack/node/second.py) first: it needs node 1's apiserver to delete its pods.
    down_second(state, cache=cache)
    paths = node_paths(state, cache)
    kubelet_up = any(p.name == "kubelet" and p.alive() for p in state.procs)
    if kubelet_up and state.server:
        delete_all_pods(state)
        wait_for_no_tasks(paths)
    # kube-router first: stopped, it leaves its rules in place (cleaned with the host below).
    stop_named(state, "kube-router", "coredns", "kube-proxy", "kubelet")
    if any(p.name == "containerd" and p.alive() for p in state.procs):
        remove_stale_containers(paths)
    stop_named(state, "containerd")
    kill_leftover_shims(paths)
    if stop_control_plane is not None:
        stop_control_plane()
    host.cleanup_host(ip_forward_before=state.node.get("ip_forward_before"),
                      bridge_nf_before=state.node.get("bridge_nf_before"),
                      created_dirs=state.node.get("created_dirs", []))
    state.node = {}
    state.save()
