"""The real-node tier of the harness itself (hack/node): a node comes up with what the e2e suite
relies on, keeps pod traffic on the machine, and `down` leaves the host as it was.

This module starts and stops a node of its own, so it must run while no other node runs:
tests/e2e/conftest.py moves it before every test that uses the session `node` fixture.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cluster
from tests.e2e.conftest import ensure_node_binaries, require_root
from tests.e2e.support import Kubectl, restricted_pod, wait_for


def host_state() -> dict[str, Any]:
    """What a node (and node 2, hack/node/second.py) changes on the host, read from the host."""
    from hack.node import host, second_config

    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           check=True).stdout
    mounts = Path("/proc/self/mountinfo").read_text()
    return {
        "iptables": host.iptables_snapshot(),
        "links": sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()),
        "ip_forward": host.read_ip_forward(),
        "kubepods": sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/kubepods")),
        # "elastrain-node" also matches node 2's run dir, where its namespace files are mounted.
        "mounts": sorted(line.split()[4] for line in mounts.splitlines()
                         if "elastrain-node" in line or "/run/netns/cni-" in line),
        "netns": sorted(p.name for p in Path("/run/netns").glob("cni-*"))
        if Path("/run/netns").is_dir() else [],
        "run_dir": Path("/run/elastrain-node").exists(),
        "node2_cgroups": sorted(str(p) for p in
                                Path("/sys/fs/cgroup").glob(f"*/{second_config.CGROUP_ROOT}")),
        "node2_run_dir": second_config.RUN_DIR.exists(),
        "node2_private_dirs": [d.exists() for d in second_config.PRIVATE_DIRS],
        "routes": subprocess.run(["ip", "route", "show"], capture_output=True, text=True,
                                 check=True).stdout,
    }


PROBE = """
import json, socket, subprocess
out = {}
out["routes"] = open("/proc/net/route").read().split("\\n")[1:]
try:
    out["dns"] = socket.gethostbyname("kubernetes.default.svc.cluster.local")
except OSError as e:
    out["dns"] = repr(e)
s = socket.socket(); s.settimeout(5)
try:
    s.connect(("kubernetes.default.svc.cluster.local", 443)); out["service"] = "connected"
except OSError as e:
    out["service"] = repr(e)
s = socket.socket(); s.settimeout(5)
try:
    s.connect(("192.0.2.1", 53)); out["outside"] = "connected"
except OSError as e:
    out["outside"] = type(e).__name__ + ": " + str(e)
print("PROBE " + json.dumps(out), flush=True)
"""


def test_node_runs_pods_keeps_traffic_inside_and_down_restores_the_host(
        tmp_path: Path) -> None:
    require_root()
    ensure_node_binaries()  # this module runs before the session node, which would build them
    images = cluster.node_images(("pause", "operator"))
    before = host_state()
    state = cluster.up(tmp_path / "node", tier="node", s3=True, die_with_parent=True,
                       images=images)
    try:
        k = Kubectl(Path(state.kubeconfig))
        node = k.json("get", "node", "elastrain-node")
        assert [a["address"] for a in node["status"]["addresses"]
                if a["type"] == "InternalIP"] == ["10.244.0.1"]
        assert not node["spec"].get("taints"), "the not-ready taint was never lifted"
        pod = restricted_pod("probe", "default", image=images["operator"][0],
                             command=["python3", "-c", PROBE])
        k("apply", "-f", "-", input_text=json.dumps(pod))
        wait_for("the probe pod to finish", lambda: k(
            "get", "pod", "probe", "-o", "jsonpath={.status.phase}").stdout in
            ("Succeeded", "Failed"), timeout=120)
        line = next(x for x in k("logs", "probe").stdout.splitlines() if x.startswith("PROBE "))
        probe = json.loads(line.removeprefix("PROBE "))
        assert probe["dns"] == "10.96.0.1", probe  # CoreDNS answers cluster names
        assert probe["service"] == "connected", probe  # kube-proxy: ClusterIP -> apiserver
        assert "unreachable" in probe["outside"].lower(), probe  # no default route out
        default_routes = [r for r in probe["routes"] if r.split("\t")[1:2] == ["00000000"]]
        assert default_routes == [], probe["routes"]
        # A node 2 added (tests/e2e/test_harness_two_nodes.py tests it) goes with node 1's
        # `down`, which leaves the host as before all the same.
        cluster.up_second_node(tmp_path / "node", images=images, die_with_parent=True)
        assert "elastrain-n2" in host_state()["links"]
    finally:
        cluster.down(tmp_path / "node")
    assert host_state() == before


def test_a_second_node_is_refused_while_one_runs(tmp_path: Path) -> None:
    require_root()
    ensure_node_binaries()
    images = cluster.node_images(("pause",))
    cluster.up(tmp_path / "one", tier="node", s3=False, die_with_parent=True, images=images)
    try:
        with pytest.raises(cluster.ClusterError, match="already runs"):
            cluster.up(tmp_path / "two", tier="node", s3=False, die_with_parent=True,
                       images=images)
    finally:
        cluster.down(tmp_path / "one")
        cluster.down(tmp_path / "two")
