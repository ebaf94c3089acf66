"""The host side of node 2: its network and mount namespaces, the veth link and routes, the
firewall chain, its cgroup root, the partition knob, and the cleanup that removes all of it.

What node 2 adds to the host, and how `cleanup` undoes it:
- RUN_DIR with two bind-mounted namespace files (net, mnt): unmounted, the namespaces die with
  their last process, and with the network namespace its bridge, pods' veths, iptables rules and
  sysctls, and the node's end of the veth pair;
- the host's end of the veth pair, with its address and the route to node 2's pods: deleted;
- FIREWALL_CHAIN in mangle FORWARD (v4 and v6): deleted;
- while partitioned, a DROP rule in the host's raw PREROUTING: deleted;
- /<CGROUP_ROOT> in every cgroup hierarchy: removed once its processes are gone;
- PRIVATE_DIRS that had to be created as mount points (/run/containerd): removed when empty.
Node 2's mounts (tmpfs over PRIVATE_DIRS, container root filesystems, pod volumes, its pods'
network namespaces) live only in its mount namespace and vanish with it. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from hack.cluster_state import ClusterError
from hack.node.host import CGROUP_ROOT as CGROUPS
from hack.node.host import remove_cgroup_tree, run, unmount_under
from hack.node.second_config import (
    CGROUP_ROOT,
    HOST_VETH,
    MNT_NS,
    NET_NS,
    NODE_SYSCTLS,
    PRIVATE_DIRS,
    RUN_DIR,
    nsenter,
    plan_firewall,
    plan_heal,
    plan_host_link,
    plan_node_network,
    plan_partition,
    plan_unfirewall,
)


def _run_all(plan: list[list[str]]) -> None:
    for argv in plan:
        done = run(*argv, check=False)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


# ------------------------------------------------------------------------------------ namespaces


def create_namespaces() -> None:
    """The mount namespace first, then the network namespace: made in that order, the mount
    namespace holds no copy of the network namespace's bind mount, so unmounting it on the host
    is enough to free it. PRIVATE_DIRS are created as mount points when missing."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    for directory in PRIVATE_DIRS:
        directory.mkdir(parents=True, exist_ok=True)
    MNT_NS.touch()
    # The new namespace starts with a copy of every host mount, node 1's included (its pods'
    # network namespaces, volumes, container root filesystems): copies that would pin them
    # after node 1 removes them. They go first, lazily, deepest first.
    node_1 = "^/run/(elastrain-node|netns|containerd)(/|$)"
    forget = (f"awk '{{print $5}}' /proc/self/mountinfo | grep -E '{node_1}' | sort -r | "
              "while read -r m; do umount -l \"$m\"; done")
    mounts = " && ".join(f"mount -t tmpfs -o mode=0755 elastrain-n2 {d}" for d in PRIVATE_DIRS)
    _run_all([["unshare", f"--mount={MNT_NS}", "--propagation", "private", "sh", "-c",
               f"{forget}; {mounts}"]])
    NET_NS.touch()
    _run_all([["unshare", f"--net={NET_NS}", "true"]])


def create_network() -> None:
    """The link, node 2's addresses and routes, its sysctls, and the host's firewall chain."""
    _run_all(plan_host_link())
    _run_all([nsenter(*argv, mount=False) for argv in plan_node_network()])
    for key, value in NODE_SYSCTLS.items():
        # /proc/sys/net is the writer's network namespace's.
        _run_all([nsenter("sh", "-c", f"echo {value} > /proc/sys/{key}", mount=False)])
    for tool in ("iptables", "ip6tables"):
        for argv in plan_unfirewall(tool):  # a killed session's chain, if any
            run(*argv, check=False)
        _run_all(plan_firewall(tool))


def namespace_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


# ---------------------------------------------------------------------------------------- cgroups


def cgroup_dirs() -> list[Path]:
    """/<CGROUP_ROOT> in every hierarchy (cgroup v1 hybrid here: one per controller, plus the
    named systemd one and cgroup2's unified)."""
    return [h / CGROUP_ROOT for h in sorted(CGROUPS.iterdir())
            if h.is_dir() and not h.is_symlink()]


def create_cgroup_root() -> None:
    """The kubelet refuses a cgroupRoot that does not exist in every hierarchy. A new v1 cpuset
    cgroup has no CPUs or memory nodes until given its parent's."""
    for path in cgroup_dirs():
        path.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (path / name).exists() and not (path / name).read_text().strip():
                (path / name).write_text((path.parent / name).read_text())


def remove_cgroup_root() -> None:
    for top in cgroup_dirs():
        if top.is_dir():
            remove_cgroup_tree(top)


# ------------------------------------------------------------------------------------- processes


def leftover_pids() -> set[int]:
    """Processes still in node 2's cgroups (its containers) or mount namespace (shims, and
    anything started there)."""
    pids: set[int] = set()
    for top in cgroup_dirs():
        for procs in top.rglob("cgroup.procs") if top.is_dir() else []:
            with suppress(OSError, ValueError):
                pids |= {int(p) for p in procs.read_text().split()}
    mnt = namespace_inode(MNT_NS)
    if mnt is not None:
        for entry in Path("/proc").glob("[0-9]*"):
            with suppress(OSError):
                if os.stat(entry / "ns" / "mnt").st_ino == mnt:
                    pids.add(int(entry.name))
    pids.discard(os.getpid())
    return pids


def kill_leftovers(timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (pids := leftover_pids()) and time.monotonic() < deadline:
        for pid in pids:
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


# ------------------------------------------------------------------------------------ fault knobs


def partition() -> None:
    """Node 2 cut off: every frame to or from it dropped (second_config.plan_partition)."""
    _run_all(plan_partition())


def heal() -> None:
    _run_all(plan_heal())


def is_partitioned() -> bool:
    check = plan_partition("-C")[0]
    return run(*check, check=False).returncode == 0


# ---------------------------------------------------------------------------------------- cleanup


def cleanup(*, created_dirs: Sequence[str]) -> None:
    """After node 2's processes are stopped: the module docstring's list, undone.
    `created_dirs`: the PRIVATE_DIRS that did not exist before node 2 (removed when empty: node
    1's shims may have put theirs in /run/containerd since, and node 1's cleanup removes it)."""
    kill_leftovers()
    while is_partitioned():
        run(*plan_heal()[0])
    run("ip", "link", "delete", HOST_VETH, check=False)
    for tool in ("iptables", "ip6tables"):
        for argv in plan_unfirewall(tool):
            run(*argv, check=False)
    for ns in (MNT_NS, NET_NS):
        unmount_under(ns)
    for _ in range(50):  # rmdir fails while a killed process is still exiting
        remove_cgroup_root()
        if not any(p.is_dir() for p in cgroup_dirs()):
            break
        time.sleep(0.1)
    unmount_under(RUN_DIR)
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    for directory in created_dirs:
        with suppress(OSError):
            Path(directory).rmdir()
