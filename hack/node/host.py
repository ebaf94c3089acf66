"""The host side of the real node: Debian packages, the bridge, the firewall chain, ip_forward,
the machine-wide lock, and the cleanup that leaves the host as it was.

What the node changes on the host, and how `cleanup_host` undoes it (note, pitfalls 6, 9, 11):
- the bridge BRIDGE (created here, deleted at the end; CNI attaches pods' veths to it);
- iptables: our FIREWALL_CHAIN in mangle's FORWARD (pod traffic stays on the bridge) and
  kube-proxy's, kube-router's and the kubelet's KUBE-* chains, v4 and v6 (`kube-proxy --cleanup`
  misses KUBE-FIREWALL);
- net.ipv4.ip_forward: the CNI bridge plugin and Services need it on; restored to its old value;
- net.bridge.bridge-nf-call-iptables: on, so kube-router's rules see pod-to-pod frames on the
  bridge; restored to its old value;
- kube-router's ipsets (KUBE-SRC-*, KUBE-DST-*), destroyed after the rules that use them;
- a routing rule: what pods send to the Service range and no Service rewrote is unreachable
  (install_service_rule says why); deleted at the end;
- mounts under RUN_DIR (pod volumes, container rootfs, sandbox shm) and /run/netns/cni-*;
- cgroups: /kubepods in every hierarchy;
- RUN_DIR itself, and those of config.FIXED_HOST_DIRS (/run/containerd, /run/netns,
  /var/lib/cni, /var/log/pods) that did not exist before the node.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from hack.cluster_state import SERVICE_CIDR, ClusterError
from hack.debian import PackageError, ensure_packages
from hack.node.config import (
    BRIDGE,
    FIREWALL_CHAIN,
    LOCK_FILE,
    NODE_IP,
    OWNER_FILE,
    POD_CIDR,
    RUN_DIR,
)

# Debian package -> a program it installs; installed with apt-get when the program is missing.
PACKAGES = {"containerd": "containerd", "runc": "runc",
            "containernetworking-plugins": "/usr/lib/cni/bridge", "iptables": "iptables",
            "conntrack": "conntrack", "iproute2": "ip", "ipset": "ipset"}
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
IPSET_PREFIXES = ("KUBE-", "kube-router")  # kube-router's; nothing else here makes ipsets
CGROUP_ROOT = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/run/netns")


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=120)


# ---------------------------------------------------------------------------------- prerequisites


def install_packages() -> None:
    """The node's Debian packages, installed when missing."""
    try:
        ensure_packages(PACKAGES, why="the real node")
    except PackageError as err:
        raise ClusterError(str(err)) from err


def check_privileges() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the real node needs root (bridge, iptables, cgroups, mounts)")


# ------------------------------------------------------------------------------------------- lock


@contextmanager
def node_lock(timeout: float = 600) -> Iterator[None]:
    """Serialises setting up and tearing down nodes on this machine (one node per machine)."""
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with LOCK_FILE.open("a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"{LOCK_FILE} held for {timeout:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_owner() -> dict[str, object] | None:
    """The running node's record: which cluster dir owns it (None when no node is recorded)."""
    try:
        owner: dict[str, object] = json.loads(OWNER_FILE.read_text())
    except (OSError, ValueError):
        return None
    return owner


def write_owner(cluster_dir: Path, pids: dict[str, int]) -> None:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    OWNER_FILE.write_text(json.dumps({"dir": str(cluster_dir), "pids": pids}) + "\n")


# ---------------------------------------------------------------------------------------- network


def read_ip_forward() -> str:
    return IP_FORWARD.read_text().strip()


def write_ip_forward(value: str) -> None:
    IP_FORWARD.write_text(value + "\n")


def read_bridge_netfilter() -> str:
    """"" when the kernel has no br_netfilter: bridged pod traffic then never meets iptables,
    and kube-router could not enforce anything between pods (start_node fails on it)."""
    return BRIDGE_NF.read_text().strip() if BRIDGE_NF.exists() else ""


def write_bridge_netfilter(value: str) -> None:
    if not BRIDGE_NF.exists():
        raise ClusterError(f"{BRIDGE_NF} is missing: this kernel has no br_netfilter, so no "
                           "NetworkPolicy enforcer can see pod-to-pod traffic on the bridge")
    BRIDGE_NF.write_text(value + "\n")


def create_bridge() -> None:
    """The bridge exists before anything binds NODE_IP (apiserver, CoreDNS, MinIO bind it)."""
    if run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        run("ip", "link", "add", BRIDGE, "type", "bridge")
    prefix = POD_CIDR.split("/")[1]
    if NODE_IP not in run("ip", "-4", "addr", "show", "dev", BRIDGE).stdout:
        run("ip", "addr", "add", f"{NODE_IP}/{prefix}", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")


def delete_bridge() -> None:
    run("ip", "link", "delete", BRIDGE, check=False)


def install_firewall() -> None:
    """Pods talk to each other and to the host, nothing else: frames forwarded between the bridge
    and any other interface are dropped, both ways. In the mangle table, which every forwarded
    packet passes before the filter table: kube-router keeps its own jump first in filter's
    FORWARD and ACCEPTs there what a NetworkPolicy allows, so a drop in filter came too late."""
    for tool in ("iptables", "ip6tables"):
        table = (tool, "-t", "mangle")
        if run(*table, "-n", "-L", FIREWALL_CHAIN, check=False).returncode != 0:
            run(*table, "-N", FIREWALL_CHAIN)
        run(*table, "-F", FIREWALL_CHAIN)
        run(*table, "-A", FIREWALL_CHAIN, "-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP")
        run(*table, "-A", FIREWALL_CHAIN, "!", "-i", BRIDGE, "-o", BRIDGE, "-j", "DROP")
        if run(*table, "-C", "FORWARD", "-j", FIREWALL_CHAIN, check=False).returncode != 0:
            run(*table, "-I", "FORWARD", "1", "-j", FIREWALL_CHAIN)


SERVICE_RULE = ("iif", BRIDGE, "to", SERVICE_CIDR, "unreachable")


def install_service_rule() -> None:
    """Packets from pods to a ClusterIP that kube-proxy did not rewrite (a Service without
    ready endpoints, such as the rendezvous store's while it starts) are answered "no route to
    host" at once. kube-proxy REJECTs them in the filter table's FORWARD chain, but kube-router
    ACCEPTs a policy-selected pod's traffic earlier in that chain (its jump is kept first), so
    they followed the host's default route out of the machine instead: a worker's connect() to
    the store hung until torch's 60 s timeout (seen: every first worker of a job lost its
    rendezvous). torch retries "no route to host" like "connection refused". Rewritten packets
    are routed by their new (pod) address, and the host's own traffic (no `iif`) is untouched."""
    if "unreachable" not in run("ip", "rule", "show", "iif", BRIDGE, check=False).stdout:
        run("ip", "rule", "add", *SERVICE_RULE)


def remove_service_rule() -> None:
    while run("ip", "rule", "del", *SERVICE_RULE, check=False).returncode == 0:
        pass


def _ours(chain: str) -> bool:
    """KUBE-* and ours: FIREWALL_CHAIN, and node 2's (hack/node/second_config.py), should its own
    teardown have failed."""
    return chain.startswith(("KUBE-", "ELASTRAIN-")) or chain == FIREWALL_CHAIN


def remove_iptables_chains() -> None:
    """Deletes every rule that jumps to a KUBE-* or our chain, then those chains, in every table,
    v4 and v6. Parsing iptables-save catches what `kube-proxy --cleanup` leaves (KUBE-FIREWALL,
    KUBE-KUBELET-CANARY)."""
    for tool in ("iptables", "ip6tables"):
        saved = run(f"{tool}-save", check=False).stdout
        table = ""
        chains: dict[str, list[str]] = {}
        jumps: list[tuple[str, list[str]]] = []
        for line in saved.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                name = line[1:].split()[0]
                if _ours(name):
                    chains.setdefault(table, []).append(name)
            elif line.startswith("-A "):
                parts = line.split()
                target = parts[parts.index("-j") + 1] if "-j" in parts else ""
                if _ours(target) and not _ours(parts[1]):
                    jumps.append((table, parts[1:]))
        for table_name, rule in jumps:
            run(tool, "-t", table_name, "-D", *_unquote(rule), check=False)
        for table_name, names in chains.items():
            for name in names:
                run(tool, "-t", table_name, "-F", name, check=False)
            for name in names:
                run(tool, "-t", table_name, "-X", name, check=False)


def _unquote(rule: list[str]) -> list[str]:
    """iptables-save quotes comments ("--comment \"a b\""): rejoin them into one argument."""
    out: list[str] = []
    buf: list[str] | None = None
    for part in rule:
        if buf is not None:
            buf.append(part)
            if part.endswith('"'):
                out.append(" ".join(buf)[1:-1])
                buf = None
        elif part.startswith('"') and not (part.endswith('"') and len(part) > 1):
            buf = [part]
        else:
            out.append(part.strip('"') if part.startswith('"') else part)
    return out


def remove_ipsets() -> None:
    """kube-router's ipsets; they can go only once no iptables rule refers to them."""
    if not shutil.which("ipset"):
        return
    for name in run("ipset", "list", "-n", check=False).stdout.split():
        if name.startswith(IPSET_PREFIXES):
            run("ipset", "destroy", name, check=False)


def iptables_snapshot() -> str:
    """Rules and chains without counters, v4 and v6: what a test compares before and after a
    node. A table holding nothing but ACCEPT policies is left out: merely listing a table
    (iptables -t nat -S) creates it empty with nf_tables, which changes no behaviour."""
    out: list[str] = []
    for tool in ("iptables-save", "ip6tables-save"):
        table: list[str] = []
        for line in run(tool, check=False).stdout.splitlines():
            if line.startswith("#"):
                continue
            line = line.split(" [")[0] if line.startswith(":") else line
            table.append(line)
            if line == "COMMIT":
                inert = all(x.startswith("*") or x == "COMMIT" or
                            (x.startswith(":") and x.endswith(" ACCEPT")) for x in table)
                if not inert:
                    out += [tool, *table]
                table = []
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- cleanup


def unmount_under(*prefixes: Path) -> None:
    """Lazily unmounts every mount point at or below the prefixes, deepest first."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(p) or point.startswith(f"{p}/") for p in prefixes):
            mounts.append(point)
    for point in sorted(set(mounts), key=len, reverse=True):
        run("umount", "-l", point, check=False)


def remove_netns() -> None:
    """The CRI's pod network namespaces (cni-<uuid>), left when containerd stopped with pods."""
    if not NETNS_DIR.is_dir():
        return
    for ns in NETNS_DIR.glob("cni-*"):
        run("ip", "netns", "delete", ns.name, check=False)
        unmount_under(ns)
        ns.unlink(missing_ok=True)


def remove_kubepods_cgroups() -> None:
    """rmdir /kubepods (the kubelet's cgroupfs root) in every hierarchy, leaves first; works only
    once no process is left in them."""
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / "kubepods"
        if not top.is_dir():
            continue
        remove_cgroup_tree(top)


def remove_cgroup_tree(top: Path) -> None:
    """rmdir a cgroup and its children, leaves first (a cgroup goes only once it is empty)."""
    dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                  reverse=True)
    for path in [*dirs, top]:
        with suppress(OSError):
            path.rmdir()


def cleanup_host(*, ip_forward_before: str | None, created_dirs: Sequence[str],
                 bridge_nf_before: str | None = None) -> None:
    """Everything the module docstring lists, in an order that works with processes gone."""
    remove_iptables_chains()
    remove_ipsets()
    remove_service_rule()
    remove_netns()
    unmount_under(RUN_DIR)
    delete_bridge()
    remove_kubepods_cgroups()
    if ip_forward_before is not None:
        write_ip_forward(ip_forward_before)
    if bridge_nf_before:
        write_bridge_netfilter(bridge_nf_before)
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    for directory in map(Path, created_dirs):
        unmount_under(directory)
        shutil.rmtree(directory, ignore_errors=True)
