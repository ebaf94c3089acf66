"""Node 2's configs and command plans (hack/node/second_config.py): what isolates it from node 1
and keeps its traffic on the machine. Pure: strings and argv lists; nothing starts."""

from __future__ import annotations

import importlib
import ipaddress
import json
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _module(name: str) -> ModuleType:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def config() -> ModuleType:
    return _module("hack.node.config")


@pytest.fixture(scope="module")
def second() -> ModuleType:
    return _module("hack.node.second_config")


@pytest.fixture
def paths(config: ModuleType, second: ModuleType, tmp_path: Path) -> object:
    return config.NodePaths(cluster_dir=tmp_path, containerd_root=tmp_path / "ctrd2",
                            run_dir=second.RUN_DIR, config_name="node2")


def test_node_2_addresses_fit_the_cluster_pod_range_and_differ_from_node_1(
        config: ModuleType, second: ModuleType) -> None:
    cluster = ipaddress.ip_network(config.CLUSTER_POD_CIDR)
    one, two = ipaddress.ip_network(config.POD_CIDR), ipaddress.ip_network(second.POD_CIDR)
    link = ipaddress.ip_network(f"{second.HOST_LINK_IP}/{second.LINK_PREFIX}", strict=False)
    assert one.subnet_of(cluster) and two.subnet_of(cluster) and link.subnet_of(cluster)
    assert not one.overlaps(two) and not link.overlaps(one) and not link.overlaps(two)
    assert ipaddress.ip_address(second.NODE_IP) in two
    assert ipaddress.ip_address(second.NODE_LINK_IP) in link
    assert second.SECOND.name != config.FIRST.name
    assert second.SECOND.bridge != config.BRIDGE
    assert len(second.HOST_VETH) <= 15  # IFNAMSIZ


def test_node_2_paths_are_its_own(config: ModuleType, paths: object) -> None:
    one = config.NodePaths(cluster_dir=Path("/c"), containerd_root=Path("/r"))
    for name in ("containerd_state", "containerd_socket", "kubelet_root", "cni_data_dir"):
        assert getattr(paths, name) != getattr(one, name), name
    assert paths.config_dir.name == "node2"  # type: ignore[attr-defined]


def test_node_2_cni_uses_its_bridge_and_cidr_and_routes_only_cluster_ranges(
        config: ModuleType, second: ModuleType, paths: object) -> None:
    conf = json.loads(config.render_cni_config(paths, service_cidr="10.96.0.0/24",
                                               node=second.SECOND))
    bridge = conf["plugins"][0]
    assert bridge["bridge"] == second.BRIDGE2
    assert bridge["ipMasq"] is False and bridge["isDefaultGateway"] is False
    assert bridge["ipam"]["ranges"] == [[{"subnet": second.POD_CIDR, "rangeStart": "10.244.1.10",
                                          "gateway": second.NODE_IP}]]
    assert bridge["ipam"]["routes"] == [{"dst": "10.96.0.0/24"}, {"dst": "10.244.0.0/16"}]
    assert bridge["ipam"]["dataDir"] == str(paths.cni_data_dir)  # type: ignore[attr-defined]


def test_node_2_kubelet_has_its_own_cgroup_root_address_and_probe_address(
        config: ModuleType, second: ModuleType, tmp_path: Path) -> None:
    files = config.KubeletFiles(ca=tmp_path / "ca", serving_cert=tmp_path / "c",
                                serving_key=tmp_path / "k", resolv_conf=tmp_path / "r")
    two = json.loads(config.render_kubelet_config(files, healthz_port=1, node=second.SECOND))
    one = json.loads(config.render_kubelet_config(files, healthz_port=1))
    assert two["cgroupRoot"] == "/elastrain-n2" and "cgroupRoot" not in one
    assert two["address"] == second.NODE_IP
    # The host's harness probes it: node 2's loopback is not the host's.
    assert two["healthzBindAddress"] == second.NODE_IP
    assert one["healthzBindAddress"] == "127.0.0.1"
    assert two["clusterDNS"] == [config.NODE_IP]  # node 1's CoreDNS serves both
    assert {k: v for k, v in two.items() if k not in ("address", "healthzBindAddress",
                                                       "cgroupRoot")} == \
        {k: v for k, v in one.items() if k not in ("address", "healthzBindAddress")}


def test_node_2_kube_proxy_is_named_for_it(config: ModuleType, second: ModuleType,
                                           tmp_path: Path) -> None:
    proxy = json.loads(config.render_kube_proxy_config(tmp_path / "kc", healthz_port=1,
                                                       metrics_port=2, node=second.SECOND))
    assert proxy["hostnameOverride"] == second.NAME
    assert proxy["clusterCIDR"] == second.POD_CIDR
    assert proxy["nodePortAddresses"] == [f"{second.NODE_IP}/32"]
    assert proxy["healthzBindAddress"] == f"{second.NODE_IP}:1"
    assert proxy["conntrack"]["maxPerCore"] == 0


def test_node_2_containerd_keeps_its_own_socket_and_root(config: ModuleType,
                                                          paths: object) -> None:
    doc = tomllib.loads(config.render_containerd_config(paths, sandbox_image="x/pause:1"))
    assert doc["grpc"]["address"] == "/run/elastrain-node2/containerd.sock"
    assert doc["state"] == "/run/elastrain-node2/containerd"
    assert doc["root"] == str(paths.containerd_root)  # type: ignore[attr-defined]


def test_node_2_network_has_no_default_route(second: ModuleType) -> None:
    plan = second.plan_node_network() + second.plan_host_link()
    routes = [argv for argv in plan if argv[1:3] == ["route", "add"]]
    assert routes == [["ip", "route", "add", "10.244.0.0/16", "via", second.HOST_LINK_IP, "dev",
                       second.NODE_VETH],
                      ["ip", "route", "add", second.POD_CIDR, "via", second.NODE_LINK_IP, "dev",
                       second.HOST_VETH]]
    assert not any("default" in argv for argv in plan)
    # The node's end is created inside its network namespace, never on the host.
    assert plan[-4][-2:] == ["netns", str(second.NET_NS)]


def test_the_firewall_lets_only_the_two_nodes_pods_through(config: ModuleType,
                                                           second: ModuleType) -> None:
    plan = second.plan_firewall()
    rules = [argv[5:] for argv in plan if argv[3] == "-A"]
    assert rules == [["-i", config.BRIDGE, "-o", second.HOST_VETH, "-j", "ACCEPT"],
                     ["-i", second.HOST_VETH, "-o", config.BRIDGE, "-j", "ACCEPT"],
                     ["-i", second.HOST_VETH, "-j", "DROP"],
                     ["-o", second.HOST_VETH, "-j", "DROP"]]
    # Ahead of node 1's chain, which drops everything forwarded off its bridge.
    assert plan[-1] == ["iptables", "-t", "mangle", "-I", "FORWARD", "1", "-j",
                        second.FIREWALL_CHAIN]
    assert all("ACCEPT" not in argv for argv in second.plan_firewall("ip6tables"))
    undo = second.plan_unfirewall()
    assert undo[0] == ["iptables", "-t", "mangle", "-D", "FORWARD", "-j", second.FIREWALL_CHAIN]


def test_the_partition_drops_on_arrival_both_ways_and_heal_undoes_it(
        second: ModuleType) -> None:
    host, node = second.plan_partition()
    # From node 2, dropped as it reaches the host; to node 2, as it reaches node 2: never on
    # the way out, where the sender's own send would fail at once (EPERM).
    assert host == ["iptables", "-w", "-t", "raw", "-I", "PREROUTING", "1", "-i",
                    second.HOST_VETH, "-j", "DROP"]
    assert node[:3] == ["nsenter", f"--net={second.NET_NS}", "--"]
    assert node[3:] == ["iptables", "-w", "-t", "raw", "-I", "PREROUTING", "1", "-i",
                        second.NODE_VETH, "-j", "DROP"]
    assert not any("down" in argv or "OUTPUT" in argv for argv in (host, node))
    heal = second.plan_heal()
    assert [argv[argv.index("-t") + 2] for argv in heal] == ["-D", "-D"]
    assert [[a for a in argv if a not in ("-D", "1")] for argv in heal] == \
        [[a for a in argv if a not in ("-I", "1")] for argv in (host, node)]


def test_nsenter_enters_both_namespaces(second: ModuleType) -> None:
    assert second.nsenter("kubelet", "--v=1") == [
        "nsenter", f"--net={second.NET_NS}", f"--mount={second.MNT_NS}", "--", "kubelet",
        "--v=1"]
    assert second.nsenter("ip", "a", mount=False)[:3] == ["nsenter", f"--net={second.NET_NS}",
                                                          "--"]
