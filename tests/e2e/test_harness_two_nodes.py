"""The second real node of the harness (hack/node/second.py): added to the session's cluster, it
runs pods that reach node 1's pods, cluster DNS, Services and the apiserver; its fault knobs
partition it and stop its runtime; removed, it leaves the host as it found it.

The tests run in order on one node 2 (module scope): the knobs' tests heal and restart what they
break, and the last test removes node 2 itself and compares the host with its state before.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hack.cluster_servers import NODE_MONITOR_GRACE_S
from tests.e2e.conftest import NodeCluster, SecondNode, added_second_node
from tests.e2e.support import Kubectl, restricted_pod, wait_for

NODE_1 = "elastrain-node"
PORT = 8080

# Each pod answers every connection with its hostname.
SERVER = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT}))
s.listen(16)
print("SERVING", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode())
    c.close()
"""

CONNECT = """
import json, socket, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        print(json.dumps({"reply": s.recv(100).decode()}))
except OSError as e:
    print(json.dumps({"error": type(e).__name__ + ": " + str(e)}))
"""

RESOLVE = """
import socket, sys
print(socket.gethostbyname(sys.argv[1]))
"""

# Authenticated with the pod's ServiceAccount token: the apiserver says who the caller is.
WHOAMI = """
import json, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
ctx = ssl.create_default_context(cafile=sa + "ca.crt")
body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
req = urllib.request.Request(
    "https://kubernetes.default.svc/apis/authentication.k8s.io/v1/selfsubjectreviews",
    data=body.encode(), method="POST",
    headers={"Authorization": "Bearer " + open(sa + "token").read(),
             "Content-Type": "application/json"})
with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
    print(json.load(resp)["status"]["userInfo"]["username"])
"""


def host_state() -> dict[str, Any]:
    """What node 2 adds to the host (hack/node/namespaces.py lists it), read from the host."""
    from hack.node import second_config as n2

    def out(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    procs = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(n2.RUN_DIR).encode() in cmdline.read_bytes():
                procs.append(cmdline.parent.name)
        except OSError:
            pass
    links = (line.split(":")[1].strip().split("@")[0]
             for line in out("ip", "-o", "link", "show").splitlines())
    return {
        # Node 1's pods' veths come and go; node 2's are in its own network namespace.
        "links": sorted(name for name in links if not name.startswith("veth")),
        "routes": out("ip", "route", "show"),
        "rules": out("ip", "rule", "show"),
        "mangle": [line for tool in ("iptables-save", "ip6tables-save")
                   for line in out(tool, "-t", "mangle").splitlines()
                   if (not line.startswith("#") and not line.startswith(":"))
                   or line.startswith(f":{n2.FIREWALL_CHAIN}")],
        "cgroups": sorted(str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{n2.CGROUP_ROOT}")),
        "mounts": sorted(line.split()[4] for line in mounts
                         if "elastrain-node2" in line or "elastrain-n2" in line),
        # Node 2's pods' namespaces are in its mount namespace only; node 1's (cni-*) come and go.
        "netns": [n for n in out("ip", "netns", "list").split() if n.startswith("elastrain")],
        "run_dir": n2.RUN_DIR.exists(),
        # Not /run/containerd: node 1's shims make it at its first pod (and its down removes it).
        "private_dirs": [d.exists() for d in n2.PRIVATE_DIRS[1:]],
        "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text(),
        "procs": procs,
    }


@dataclass(frozen=True)
class TwoNodes:
    node: NodeCluster
    second: SecondNode
    namespace: str
    before: dict[str, Any]  # the host before node 2

    @property
    def k(self) -> Kubectl:
        return self.node.kubectl

    def pod_ip(self, pod: str) -> str:
        ip: str = self.k("get", "pod", pod, "-n", self.namespace, "-o",
                         "jsonpath={.status.podIP}").stdout
        return ip

    def run_in(self, pod: str, program: str, *args: str, timeout: float = 60) -> str:
        done = self.k("exec", pod, "-n", self.namespace, "--", "python3", "-c", program, *args,
                      timeout=timeout)
        return done.stdout.strip()

    def connect(self, pod: str, host: str, port: int = PORT, timeout: float = 5) -> Any:
        return json.loads(self.run_in(pod, CONNECT, host, str(port), str(timeout)))


def connect_from_host(host: str, port: int = PORT, timeout: float = 5) -> dict[str, str]:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return {"reply": s.recv(100).decode()}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def server_pod(name: str, namespace: str, image: str, node_name: str) -> dict[str, Any]:
    """Placed by the scheduler (nodeSelector), so node 2 must be schedulable, not just there."""
    return restricted_pod(name, namespace, image=image, command=["python3", "-c", SERVER],
                          labels={"app": "peer", "peer": name}, hostname=name,
                          subdomain="peers",
                          nodeSelector={"kubernetes.io/hostname": node_name})


def service(name: str, namespace: str, selector: dict[str, str], *,
            headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": selector,
                            "ports": [{"port": 80 if not headless else PORT,
                                       "targetPort": PORT}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


@pytest.fixture(scope="module")
def two(node: NodeCluster) -> Iterator[TwoNodes]:
    before = host_state()
    with added_second_node(node) as second:
        namespace = f"two-nodes-{uuid.uuid4().hex[:4]}"
        k = node.kubectl
        k("create", "namespace", namespace)
        wait_for(f"default ServiceAccount in {namespace}", lambda: k(
            "get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0,
            timeout=30)
        image = node.images["operator"]
        k.apply(server_pod("srv-1", namespace, image, NODE_1))
        k.apply(server_pod("srv-2", namespace, image, second.name))
        k.apply(service("peers", namespace, {"app": "peer"}, headless=True))
        k.apply(service("one", namespace, {"peer": "srv-1"}))
        k.apply(service("two", namespace, {"peer": "srv-2"}))
        for pod in ("srv-1", "srv-2"):
            k("wait", "--for=condition=Ready", f"pod/{pod}", "-n", namespace, "--timeout=120s",
              timeout=130)
        yield TwoNodes(node, second, namespace, before)
        k("delete", "namespace", namespace, "--wait=false", check=False)


def test_both_nodes_are_ready_and_each_runs_a_pod(two: TwoNodes) -> None:
    nodes = {n["metadata"]["name"]: n for n in two.k.json("get", "nodes")["items"]}
    for name in (NODE_1, two.second.name):
        ready = [c["status"] for c in nodes[name]["status"]["conditions"] if c["type"] == "Ready"]
        assert ready == ["True"], name
        assert not nodes[name]["spec"].get("taints"), name
    assert [a["address"] for a in nodes[two.second.name]["status"]["addresses"]
            if a["type"] == "InternalIP"] == [two.second.ip]
    pods = {p["metadata"]["name"]: p for p in
            two.k.json("get", "pods", "-n", two.namespace)["items"]}
    assert pods["srv-1"]["spec"]["nodeName"] == NODE_1
    assert pods["srv-2"]["spec"]["nodeName"] == two.second.name
    assert pods["srv-2"]["status"]["hostIP"] == two.second.ip
    assert pods["srv-2"]["status"]["podIP"].startswith("10.244.1.")
    # Logs come from node 2's kubelet: the apiserver verified its serving certificate.
    assert "SERVING" in two.k("logs", "srv-2", "-n", two.namespace).stdout
    print(f"\nnode 2 ready in {two.second.ready_seconds:.0f} s")


def test_pods_on_the_two_nodes_reach_each_other_over_tcp(two: TwoNodes) -> None:
    assert two.connect("srv-1", two.pod_ip("srv-2")) == {"reply": "srv-2"}
    assert two.connect("srv-2", two.pod_ip("srv-1")) == {"reply": "srv-1"}


def test_a_node_2_pod_uses_cluster_dns_services_and_the_apiserver(two: TwoNodes) -> None:
    ns = two.namespace
    # Headless-Service DNS names of a pod on each node, answered by node 1's CoreDNS.
    for pod in ("srv-1", "srv-2"):
        name = f"{pod}.peers.{ns}.svc.cluster.local"
        assert two.run_in("srv-2", RESOLVE, name) == two.pod_ip(pod), name
    # ClusterIP Services through node 2's kube-proxy: to node 1's pod, and back to itself.
    assert two.connect("srv-2", f"one.{ns}.svc.cluster.local", 80) == {"reply": "srv-1"}
    assert two.connect("srv-2", f"two.{ns}.svc.cluster.local", 80) == {"reply": "srv-2"}
    # And node 1's kube-proxy sends to node 2's pod.
    assert two.connect("srv-1", f"two.{ns}.svc.cluster.local", 80) == {"reply": "srv-2"}
    assert two.run_in("srv-2", WHOAMI) == f"system:serviceaccount:{ns}:default"


def test_a_partition_makes_connections_to_node_2_time_out_until_healed(two: TwoNodes) -> None:
    target = two.pod_ip("srv-2")
    two.second.partition()
    try:
        cut = two.connect("srv-1", target, timeout=3)
        assert cut.get("error", "").startswith("TimeoutError"), cut  # silence, not refused
        from_host = connect_from_host(target, timeout=3)
        assert from_host.get("error", "").startswith("TimeoutError"), from_host
    finally:
        two.second.heal()
    wait_for("srv-2 reachable again", lambda: two.connect("srv-1", target, timeout=3)
             == {"reply": "srv-2"}, timeout=30)


def test_stopping_node_2_runtime_keeps_its_container_and_the_node_goes_not_ready(
        two: TwoNodes) -> None:
    """The controller-manager runs the node-lifecycle controller with a grace of
    NODE_MONITOR_GRACE_S (20 s; Kubernetes' default is 50 s) and the kubelets renew their lease
    every 3 s: NotReady comes about the grace after the kubelet's last renewal."""
    lease = two.k.json("get", "lease", two.second.name, "-n", "kube-node-lease")
    assert lease["spec"]["leaseDurationSeconds"] == 12, lease["spec"]
    target = two.pod_ip("srv-2")
    two.second.stop_runtime()
    stopped = time.monotonic()
    try:
        assert connect_from_host(target) == {"reply": "srv-2"}  # the container still runs

        def ready_status() -> str | None:
            node = two.k.json("get", "node", two.second.name)
            status = next(c["status"] for c in node["status"]["conditions"]
                          if c["type"] == "Ready")
            return None if status == "True" else str(status)

        assert wait_for("node 2 NotReady", ready_status, timeout=120, interval=2) == "Unknown"
        took = time.monotonic() - stopped
        print(f"\nnode 2 NotReady {took:.0f} s after its kubelet stopped")
        # Sooner than Kubernetes' default grace could give it: the harness's grace is in force.
        assert took < 50, f"NotReady {took:.0f} s after the stop (grace {NODE_MONITOR_GRACE_S} s)"
        assert connect_from_host(target) == {"reply": "srv-2"}
    finally:
        two.second.start_runtime()
    # The kubelet found the running container again: the same pod, still serving.
    two.k("wait", "--for=condition=Ready", "pod/srv-2", "-n", two.namespace, "--timeout=60s",
          timeout=70)
    assert two.pod_ip("srv-2") == target
    # Node 1's pod reaches it again within a bound, not at the first try: right after the
    # runtime returned, one connection timed out under load (full e2e runs at d04846f and
    # 8112485, both beside a `make test`), and one 5 s later was not tried.
    back = time.monotonic()
    reply = wait_for("srv-1 reaches srv-2 on node 2 again", lambda: (
        r := two.connect("srv-1", target)).get("reply") and r, timeout=60, interval=2)
    assert reply == {"reply": "srv-2"}
    print(f"srv-1 reached srv-2 {time.monotonic() - back:.0f} s after node 2's pod was Ready")


def test_removing_node_2_leaves_the_host_as_before(two: TwoNodes) -> None:
    from hack.node import second_config as n2

    two.second.down()
    assert two.k("get", "node", two.second.name, check=False).returncode != 0
    node_1 = two.k.json("get", "node", NODE_1)
    assert [c["status"] for c in node_1["status"]["conditions"] if c["type"] == "Ready"] == \
        ["True"]
    after = host_state()
    # Node 1's CNI makes /run/netns and /var/lib/cni at its first pod: when this module runs
    # first on a new node 1 (a subset run), they appear during it and are node 1's (in use, so
    # not empty), not left by node 2 (its down removes those it made once empty).
    appeared = [d for d, was, now in zip(n2.PRIVATE_DIRS[1:], two.before["private_dirs"],
                                         after["private_dirs"], strict=True) if now and not was]
    assert all(any(d.iterdir()) for d in appeared), appeared
    assert {**after, "private_dirs": None} == {**two.before, "private_dirs": None}
