"""Notices acted on first (issue 34 item 5; policy.notices), on the real apiserver and
scheduler with the operator running (its Node watch): a worker's node is tainted as Karpenter
does before it evicts; the operator starts each replacement on the other node first and deletes
an old pod only once the in-process world has its replacement (the members' /progress, a
stand-in here, names it among its spares). The only fake is the cloud's notice: the test taints
the node as Karpenter would.

The test's two Nodes are its own (own_nodes).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastrain_operator.control import job_token
from elastrain_operator.k8s.nodes import NodeNotices
from elastrain_operator.policy.notices import DEFAULT_NOTICE_TAINTS
from elastrain_operator.reconcile import Options, reconcile_once
from tests.integration.operator.conftest import Cluster, Operator, wait_for
from tests.integration.operator.own_nodes import ONLY, own_nodes, pinned
from tests.stand_in_progress import StandInProgress

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[tuple[str, str, str]]:
    # Node b cordoned at first: every pod lands on a.
    with own_nodes(cluster.kube, "notice", False, True) as (pool, (a, b)):
        yield pool, a, b


def node_of(cluster: Cluster, pod: str) -> str:
    return str((cluster.pods().get(pod) or {}).get("spec", {}).get("nodeName") or "")


def test_a_tainted_nodes_workers_move_replacement_first_and_nothing_is_counted(
        cluster: Cluster, operator: Operator, nodes: tuple[str, str, str]) -> None:
    pool, a, b = nodes
    old = ["demo-worker-0-0", "demo-worker-1-0"]
    members = StandInProgress({"step": 40, "totalSteps": 1000, "worldSize": 2,
                               "role": "member", "members": old, "spares": []})
    try:
        cluster.create_job(replicas=2, minReplicas=1, maxReplicas=2,
                           recovery={"mode": "InProcess"}, metricsPort=members.port,
                           template=pinned(pool))
        wait_for("both workers on node a", lambda: all(node_of(cluster, p) == a for p in old),
                 timeout=60)
        for pod in old:
            cluster.run(pod)
        wait_for("the job running", lambda: cluster.status().get("phase") == "Running")
        # Karpenter's notice: node b is free again, node a is tainted and about to go.
        cluster.kube.patch(f"/api/v1/nodes/{b}", {"spec": {"unschedulable": False}})
        cluster.kube.patch(f"/api/v1/nodes/{a}", {"spec": {"taints": [
            {"key": ONLY, "value": pool, "effect": "NoSchedule"},
            {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}})
        new = ["demo-worker-0-1", "demo-worker-1-1"]
        wait_for("both replacements scheduled on node b",
                 lambda: all(node_of(cluster, p) == b for p in new), timeout=60)
        cond = cluster.condition("NodeDisruptionNotice")
        assert cond["status"] == "True" and a in cond["message"], cond
        assert "karpenter.sh/disrupted" in cond["message"], cond
        # Running, but not in the world's plan yet: the old pods train on.
        for pod in new:
            cluster.run(pod)
        pods = cluster.pods()
        assert all(p in pods and not pods[p]["metadata"].get("deletionTimestamp")
                   for p in old), sorted(pods)
        # The world planned them in as spares: each old pod is asked to leave (deleted).
        members.document = {**members.document, "spares": new}
        wait_for("the old pods gone", lambda: not set(old) & set(cluster.pods(live=False)),
                 timeout=60)
        wait_for("the move over", lambda: cluster.condition("NodeDisruptionNotice")
                 .get("status") == "False", timeout=60)
    finally:
        members.close()
    status = cluster.status()
    assert (status.get("restarts"), status.get("preemptions")) == (0, 0), status
    assert sorted(cluster.pods()) == new
    messages = [e["message"] for e in cluster.events("NodeDisruptionNotice")]
    assert any(a in m and "moves" in m for m in messages), messages
    assert any("joined the world" in m for m in messages), messages


def test_a_move_is_told_to_the_trainers_in_the_round_that_starts_it(cluster: Cluster) -> None:
    """A drain may follow its notice within seconds: the old pod's trainer must know it moves
    before then (it trains on after its SIGTERM until a node can take its place), so the round
    that starts the move tells the members at once, not at the next progress poll."""
    key = b"the operator's key, 32 characters or more"
    members = StandInProgress({"step": 40, "totalSteps": 1000, "worldSize": 2,
                               "role": "member"})
    notices = NodeNotices(DEFAULT_NOTICE_TAINTS)
    with own_nodes(cluster.kube, "tell", False, False) as (pool, (a, b)):
        try:
            job = cluster.create_job(replicas=2, minReplicas=1, maxReplicas=2,
                                     recovery={"mode": "InProcess"}, metricsPort=members.port,
                                     template=pinned(pool))
            members.token = job_token(key, job["metadata"]["uid"])
            options = Options(control_key=key, notices=notices)  # a round that polls nothing
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
            old = ["demo-worker-0-0", "demo-worker-1-0"]
            wait_for("both workers scheduled", lambda: all(node_of(cluster, p) for p in old),
                     timeout=60)
            for pod in old:
                cluster.run(pod)
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
            assert members.told_moving == []
            doomed = sorted(p for p in old if node_of(cluster, p) == a) or \
                sorted(p for p in old if node_of(cluster, p) == b)
            node = node_of(cluster, doomed[0])
            cluster.kube.patch(f"/api/v1/nodes/{node}", {"spec": {"taints": [
                {"key": ONLY, "value": pool, "effect": "NoSchedule"},
                {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}})
            found = cluster.kube.get(f"/api/v1/nodes/{node}")
            assert found is not None and notices.put(found)
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
        finally:
            members.close()
    # One POST per worker (both answer at this one stand-in), in the round of the notice.
    assert members.told_moving == [doomed, doomed]
    assert members.told == [2, 2]


def test_a_restart_mode_worker_moves_once_its_replacement_is_bound_and_nothing_is_counted(
        cluster: Cluster, operator: Operator, nodes: tuple[str, str, str]) -> None:
    """Restart mode, "a save, then the move": the old pod is deleted (its SIGTERM: every
    worker saves the step and restarts) only once the replacement is bound to the other node."""
    pool, a, b = nodes
    old = ["demo-worker-0-0", "demo-worker-1-0"]
    cluster.create_job(replicas=2, minReplicas=1, maxReplicas=2, template=pinned(pool))
    wait_for("both workers on node a", lambda: all(node_of(cluster, p) == a for p in old),
             timeout=60)
    for pod in old:
        cluster.run(pod)
    wait_for("the job running", lambda: cluster.status().get("phase") == "Running")
    # Karpenter's notice on a, b still cordoned: the replacements cannot be bound, so the old
    # pods train on.
    cluster.kube.patch(f"/api/v1/nodes/{a}", {"spec": {"taints": [
        {"key": ONLY, "value": pool, "effect": "NoSchedule"},
        {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}})
    new = ["demo-worker-0-1", "demo-worker-1-1"]
    wait_for("both replacements created", lambda: set(new) <= set(cluster.pods()), timeout=60)
    assert cluster.condition("NodeDisruptionNotice")["status"] == "True"
    assert set(old) <= set(cluster.pods()) and not any(node_of(cluster, p) for p in new)
    cluster.kube.patch(f"/api/v1/nodes/{b}", {"spec": {"unschedulable": False}})
    wait_for("the old pods gone", lambda: not set(old) & set(cluster.pods(live=False)),
             timeout=60)
    assert all(node_of(cluster, p) == b for p in new)
    wait_for("the move over", lambda: cluster.condition("NodeDisruptionNotice")
             .get("status") == "False", timeout=60)
    status = cluster.status()
    assert (status.get("restarts"), status.get("preemptions")) == (0, 0), status
    messages = [e["message"] for e in cluster.events("NodeDisruptionNotice")]
    assert any("stops with a save" in m for m in messages), messages
