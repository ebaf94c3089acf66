"""Node 2's fixed names and addresses, and pure plans of the commands that wire it up.

Node 2 runs beside node 1 (hack/node/tier.py) on the same machine, in namespaces of its own, so
nothing of node 1's that is machine-wide (note, pitfall 11) is shared:
- a network namespace: its own bridge, port 10250, iptables (its kube-proxy's), ip_forward and
  bridge-nf sysctls, linked to the host by a veth pair the host routes its pod CIDR through;
- a mount namespace shared by its containerd and kubelet: a private /run/containerd (containerd
  1.6's fixed shim and runc dirs), /run/netns (its pods' network namespaces), /var/lib/cni (CNI's
  result cache) and /var/log/pods (node 1's kubelet removes log dirs of pods it does not know);
- a cgroup root, /elastrain-n2, in every hierarchy (the kubelet's cgroupRoot);
- its own run dir, config dir, certificates and containerd root (image store).

Everything here is a function of its arguments (no I/O); hack/node/namespaces.py runs the plans.
"""

from __future__ import annotations

from pathlib import Path

from hack.node.config import BRIDGE, CLUSTER_POD_CIDR, FIXED_HOST_DIRS, NodeNet

NAME = "elastrain-node-2"
POD_CIDR = "10.244.1.0/24"
NODE_IP = "10.244.1.1"  # its bridge's address, inside its network namespace
# The veth pair: a /30 inside the cluster's pod range, so pods of either node reach it directly.
HOST_VETH = "elastrain-n2"  # the host's end (also where the partition knob drops packets)
NODE_VETH = "eth0"  # node 2's end, inside its network namespace
HOST_LINK_IP = "10.244.255.1"
NODE_LINK_IP = "10.244.255.2"
LINK_PREFIX = 30
BRIDGE2 = "elastrain1"
CGROUP_ROOT = "elastrain-n2"
RUN_DIR = Path("/run/elastrain-node2")
NET_NS = RUN_DIR / "net"  # bind mounts that keep the namespaces alive without a process
MNT_NS = RUN_DIR / "mnt"
FIREWALL_CHAIN = "ELASTRAIN-NODE2"
# Mounted (tmpfs) over these inside node 2's mount namespace; the module docstring says why.
PRIVATE_DIRS = FIXED_HOST_DIRS

SECOND = NodeNet(name=NAME, bridge=BRIDGE2, ip=NODE_IP, pod_cidr=POD_CIDR,
                 range_start="10.244.1.10", probe_address=NODE_IP, cgroup_root=f"/{CGROUP_ROOT}")

Argv = list[str]


def plan_host_link() -> list[Argv]:
    """The host's side: the veth pair (node 2's end moved into its namespace at creation), the
    host's address on it, and the route to node 2's pods through it."""
    return [
        ["ip", "link", "add", HOST_VETH, "type", "veth", "peer", "name", NODE_VETH,
         "netns", str(NET_NS)],
        ["ip", "addr", "add", f"{HOST_LINK_IP}/{LINK_PREFIX}", "dev", HOST_VETH],
        ["ip", "link", "set", HOST_VETH, "up"],
        ["ip", "route", "add", POD_CIDR, "via", NODE_LINK_IP, "dev", HOST_VETH],
    ]


def plan_node_network() -> list[Argv]:
    """Inside node 2's network namespace (run there): loopback, its end of the link, its bridge
    (its node IP: the kubelet binds it) and one route, to the cluster's pod range through the
    host (node 1's pods, and the apiserver, CoreDNS and MinIO on node 1's bridge address). No
    default route: nothing leaves the machine from node 2 either."""
    return [
        ["ip", "link", "set", "lo", "up"],
        ["ip", "addr", "add", f"{NODE_LINK_IP}/{LINK_PREFIX}", "dev", NODE_VETH],
        ["ip", "link", "set", NODE_VETH, "up"],
        ["ip", "link", "add", BRIDGE2, "type", "bridge"],
        ["ip", "addr", "add", f"{NODE_IP}/{POD_CIDR.split('/')[1]}", "dev", BRIDGE2],
        ["ip", "link", "set", BRIDGE2, "up"],
        ["ip", "route", "add", CLUSTER_POD_CIDR, "via", HOST_LINK_IP, "dev", NODE_VETH],
    ]


# Per network namespace; a new namespace starts with the kernel's defaults (forwarding off).
NODE_SYSCTLS = {"net/ipv4/ip_forward": "1",
                # Pod -> ClusterIP -> pod on the same bridge: the reply must meet conntrack.
                "net/bridge/bridge-nf-call-iptables": "1"}


def plan_firewall(tool: str = "iptables") -> list[Argv]:
    """Rules of FIREWALL_CHAIN, jumped to first from mangle FORWARD, ahead of node 1's chain
    (which drops what is forwarded between its bridge and any other interface): pods of the two
    nodes reach each other, and nothing is forwarded between node 2 and anything else (the
    host's default route)."""
    table = [tool, "-t", "mangle"]
    rules = [["-i", BRIDGE, "-o", HOST_VETH, "-j", "ACCEPT"],
             ["-i", HOST_VETH, "-o", BRIDGE, "-j", "ACCEPT"],
             ["-i", HOST_VETH, "-j", "DROP"],
             ["-o", HOST_VETH, "-j", "DROP"]]
    if tool == "ip6tables":  # no IPv6 between the nodes: drop it all
        rules = rules[2:]
    return [[*table, "-N", FIREWALL_CHAIN],
            *[[*table, "-A", FIREWALL_CHAIN, *rule] for rule in rules],
            [*table, "-I", "FORWARD", "1", "-j", FIREWALL_CHAIN]]


def plan_unfirewall(tool: str = "iptables") -> list[Argv]:
    table = [tool, "-t", "mangle"]
    return [[*table, "-D", "FORWARD", "-j", FIREWALL_CHAIN],
            [*table, "-F", FIREWALL_CHAIN],
            [*table, "-X", FIREWALL_CHAIN]]


def plan_partition(action: str = "-I") -> list[Argv]:
    """Every packet between node 2 and the rest dropped where it arrives: from node 2 in the
    host's raw PREROUTING, to node 2 in its own (on its end of the link), before conntrack sees
    it. A link set down would answer senders at once (no route, ICMP errors), and a drop on the
    way out would fail the sender's own send with EPERM; dropped on arrival, a partition looks
    like silence: connections time out. (tc would do it on the host's end alone, but this
    kernel has neither the matchall classifier nor the drop action.) `action` "-D" undoes it."""
    position = ["1"] if action == "-I" else []
    return [["iptables", "-w", "-t", "raw", action, "PREROUTING", *position, "-i", HOST_VETH,
             "-j", "DROP"],
            nsenter("iptables", "-w", "-t", "raw", action, "PREROUTING", *position, "-i",
                    NODE_VETH, "-j", "DROP", mount=False)]


def plan_heal() -> list[Argv]:
    return plan_partition("-D")


def nsenter(*argv: str, mount: bool = True) -> Argv:
    """`argv` run inside node 2's network (and mount) namespace. nsenter enters them and execs
    without forking, so the PID it starts with is the program's."""
    entry = ["nsenter", f"--net={NET_NS}"]
    if mount:
        entry.append(f"--mount={MNT_NS}")
    return [*entry, "--", *argv]
