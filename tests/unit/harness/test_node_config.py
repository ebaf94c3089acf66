"""The real node's config files carry the settings its pitfalls depend on (real-node.md).

Pure: hack/node/config.py renders strings; nothing starts.
"""

from __future__ import annotations

import importlib
import json
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def config() -> ModuleType:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("hack.node.config")


@pytest.fixture
def paths(config: ModuleType, tmp_path: Path) -> object:
    return config.NodePaths(cluster_dir=tmp_path, containerd_root=tmp_path / "cache" / "ctrd")


def test_containerd_restricts_oom_score_adj_and_uses_our_cni_dir(config: ModuleType,
                                                                 paths: object) -> None:
    doc = tomllib.loads(config.render_containerd_config(paths, sandbox_image="x/pause:1"))
    cri = doc["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["sandbox_image"] == "x/pause:1"
    assert cri["cni"]["conf_dir"] == str(paths.cni_conf_dir)  # type: ignore[attr-defined]
    assert doc["grpc"]["address"] == str(paths.containerd_socket)  # type: ignore[attr-defined]
    # Never the host's default containerd: another one may run there.
    assert doc["grpc"]["address"] != "/run/containerd/containerd.sock"
    assert doc["root"] != "/var/lib/containerd"


def test_cni_keeps_pod_traffic_on_the_bridge(config: ModuleType, paths: object) -> None:
    conf = json.loads(config.render_cni_config(paths, service_cidr="10.96.0.0/24"))
    bridge = conf["plugins"][0]
    assert bridge["bridge"] == config.BRIDGE
    assert bridge["ipMasq"] is False
    assert bridge["isDefaultGateway"] is False
    # Only the Service range and the cluster's pod range (a second node's pods) are routed: no
    # default route leaves the machine.
    assert bridge["ipam"]["routes"] == [{"dst": "10.96.0.0/24"}, {"dst": "10.244.0.0/16"}]
    assert bridge["ipam"]["ranges"][0][0]["gateway"] == config.NODE_IP


def test_kubelet_binds_the_bridge_and_runs_without_systemd(config: ModuleType,
                                                          tmp_path: Path) -> None:
    files = config.KubeletFiles(ca=tmp_path / "ca", serving_cert=tmp_path / "c",
                                serving_key=tmp_path / "k", resolv_conf=tmp_path / "r")
    kubelet = json.loads(config.render_kubelet_config(files, healthz_port=1234))
    assert kubelet["address"] == config.NODE_IP
    assert kubelet["clusterDNS"] == [config.NODE_IP]
    assert kubelet["cgroupDriver"] == "cgroupfs"
    assert kubelet["readOnlyPort"] == 0
    assert kubelet["authentication"]["anonymous"]["enabled"] is False
    assert kubelet["authorization"]["mode"] == "Webhook"
    assert kubelet["makeIPTablesUtilChains"] is False
    # No registry to pull from: image GC never removes the project's images.
    assert kubelet["imageGCHighThresholdPercent"] == 100


def test_kube_proxy_leaves_host_sysctls_alone(config: ModuleType, tmp_path: Path) -> None:
    proxy = json.loads(config.render_kube_proxy_config(tmp_path / "kc", healthz_port=1,
                                                       metrics_port=2))
    assert proxy["mode"] == "iptables"
    assert proxy["nodePortAddresses"] == [f"{config.NODE_IP}/32"]
    assert proxy["conntrack"]["maxPerCore"] == 0 and proxy["conntrack"]["min"] == 0
    assert proxy["healthzBindAddress"].startswith("127.0.0.1:")


def test_coredns_binds_the_bridge_and_forwards_nothing(config: ModuleType,
                                                       tmp_path: Path) -> None:
    corefile = config.render_corefile(tmp_path / "kc", health_port=1, ready_port=2)
    assert f"bind {config.NODE_IP}" in corefile
    assert "forward" not in corefile
    assert f"kubernetes {config.CLUSTER_DOMAIN}" in corefile
