"""A pod the in-process world planned out (issue 34 item 4; policy.replace, policy.stale), on a
real apiserver: the members' control answers name it, and the operator counts it once as a
failure and creates its replacement in the same round. The old pod, on a node of the test's
own whose kubelet never answers: deleted gracefully while its node is Ready (its kubelet would
end it and confirm), so it stays Terminating; force-deleted once its Node says NotReady, as the
Node watch keeps it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from elastrain_operator.control import job_token
from elastrain_operator.k8s.nodes import NodeNotices
from elastrain_operator.reconcile import Options, reconcile_once, utcnow
from tests.integration.operator.conftest import Cluster, wait_for
from tests.integration.operator.own_nodes import own_nodes, pinned, ready_condition
from tests.stand_in_progress import StandInProgress

pytestmark = pytest.mark.cluster


def read(cluster: Cluster, node: str) -> dict[str, Any]:
    found = cluster.kube.get(f"/api/v1/nodes/{node}")
    assert found is not None
    return found


def test_a_planned_out_pod_is_replaced_counted_once_and_forced_only_once_its_node_is_lost(
        cluster: Cluster) -> None:
    key = b"the operator's key, 32 characters or more"
    # Workers 0 and 1 answer at 127.0.0.1; worker 2 went dark (nothing answers at 127.0.0.3).
    members = StandInProgress({"step": 40, "totalSteps": 100, "worldSize": 2,
                               "role": "member", "plannedOut": {"demo-worker-2-0": 20.0}})
    nodes = NodeNotices(())
    with own_nodes(cluster.kube, "lost", False) as (pool, (node,)):
        try:
            job = cluster.create_job(replicas=3, minReplicas=2, recovery={"mode": "InProcess"},
                                     metricsPort=members.port, template=pinned(pool))
            members.token = job_token(key, job["metadata"]["uid"])
            options = Options(poll_progress=True, control_key=key, notices=nodes)
            assert reconcile_once(cluster.kube, cluster.ns, "demo",
                                  Options(control_key=key)) == "success"
            names = ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
            assert cluster.worker_names() == names
            # Bound (the premise: a bound pod is its node's kubelet's to end), then running.
            wait_for("the workers on the test's node", lambda: all(
                p["spec"].get("nodeName") == node for p in cluster.pods().values()) or None)
            for name, ip in zip(names, ("127.0.0.1", "127.0.0.1", "127.0.0.3"), strict=True):
                cluster.run(name, ip=ip)
            assert cluster.kubelet is not None
            cluster.kubelet.dark.add("demo-worker-2-0")  # its kubelet confirms nothing
            nodes.put(read(cluster, node))  # the watch: Ready
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
            # Replaced and counted; the old pod asked to end, as its kubelet would be.
            pods = cluster.pods(live=False)
            assert sorted(pods) == [*names, "demo-worker-2-1"]
            assert pods["demo-worker-2-0"]["metadata"].get("deletionTimestamp")
            # Its node goes NotReady (the node controller's word): forced at once.
            cluster.kube.patch(f"/api/v1/nodes/{node}/status", {"status": {
                "conditions": [ready_condition("Unknown", "NodeStatusUnknown")]}})
            assert nodes.put(read(cluster, node))
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
        finally:
            members.close()
        # Gone, not Terminating: a graceful delete would wait for its node's kubelet forever.
        assert sorted(cluster.pods(live=False)) == ["demo-worker-0-0", "demo-worker-1-0",
                                                    "demo-worker-2-1"]
    status = cluster.status()
    assert (status["restarts"], status["preemptions"]) == (1, 0)
    (loss,) = status["recentLosses"]
    assert (loss["pod"], loss["kind"]) == ("demo-worker-2-0", "Failed")
    assert loss["reason"].startswith("planned out by the in-process world 20s ago")
    events = [e["message"] for e in cluster.events("WorkerFailed")]
    assert any("planned out" in m and "force-deleted if its kubelet never confirms" in m
               for m in events), events


def test_a_store_pod_on_a_lost_node_is_force_deleted_and_created_again(cluster: Cluster) -> None:
    """The node hosting the job's store pod goes NotReady: its kubelet would never confirm a
    delete, so the operator force-deletes the pod as soon as its Node watch says so, and
    creates it again in the next round (the trainers train on; an in-process world reclaims
    the empty store, docs/recovery.md section 7). Nothing is counted. Seen failing without the
    force: the pod stayed Running on the lost node."""
    nodes = NodeNotices(())
    store = f"/api/v1/namespaces/{cluster.ns}/pods/demo-rdzv"
    with own_nodes(cluster.kube, "storelost", False) as (pool, (node,)):
        cluster.create_job(replicas=2, minReplicas=1, recovery={"mode": "InProcess"},
                           rendezvous={"store": pinned(pool)})
        options = Options(notices=nodes)
        assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
        wait_for("the store pod on the test's node", lambda: (
            (cluster.kube.get(store) or {}).get("spec", {}).get("nodeName") == node) or None)
        old = cluster.kube.get(store)
        assert old is not None
        cluster.pod_status("demo-rdzv", {"phase": "Running", "podIP": "127.0.0.9",
                                         "conditions": [{"type": "Ready", "status": "True"}]})
        assert cluster.kubelet is not None
        cluster.kubelet.dark.add("demo-rdzv")  # its kubelet confirms nothing
        nodes.put(read(cluster, node))
        assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
        assert (cluster.kube.get(store) or {}).get("metadata", {}).get("uid") == \
            old["metadata"]["uid"]  # Ready: left alone
        cluster.kube.patch(f"/api/v1/nodes/{node}/status", {"status": {
            "conditions": [ready_condition("Unknown", "NodeStatusUnknown")]}})
        assert nodes.put(read(cluster, node))
        assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
        assert cluster.kube.get(store) is None  # gone, not Terminating
        events = [e["message"] for e in cluster.events("StoreLost")]
        assert any(f"node {node} is lost" in m for m in events), events
        assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
        new = cluster.kube.get(store)
        assert new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]
        cluster.kubelet.dark.discard("demo-rdzv")
    status = cluster.status()
    assert (status.get("restarts", 0), status.get("preemptions", 0)) == (0, 0)


def test_a_store_no_trainer_hears_is_replaced_on_another_node_while_its_own_reads_ready(
        cluster: Cluster) -> None:
    """The store's node dark but still Ready (the node controller has not yet marked it), or
    its process frozen: every member's control answer says its heartbeat has not heard the
    store for two heartbeat timeouts. The operator force-deletes the store pod (its kubelet
    confirms nothing) and the scheduler puts the next one on the pool's other node (a
    preference, not a requirement: policy.store). Seen failing before the change: the store
    stayed, Ready, on its node."""
    key = b"the operator's key, 32 characters or more"
    members = StandInProgress({"step": 40, "totalSteps": 100, "worldSize": 2, "role": "member",
                               "storeUnansweredSeconds": 12.0})
    store = f"/api/v1/namespaces/{cluster.ns}/pods/demo-rdzv"
    with own_nodes(cluster.kube, "unheard", False, False) as (pool, pool_nodes):
        try:
            job = cluster.create_job(replicas=2, minReplicas=1, metricsPort=members.port,
                                     recovery={"mode": "InProcess", "heartbeatTimeoutSeconds": 5},
                                     rendezvous={"store": pinned(pool)})
            members.token = job_token(key, job["metadata"]["uid"])
            start = utcnow()
            at = [start]
            options = Options(poll_progress=True, control_key=key, clock=lambda: at[0])
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
            old = wait_for("the store pod on a node of the pool", lambda: (
                p if (p := cluster.kube.get(store) or {}).get("spec", {}).get("nodeName")
                in pool_nodes else None))
            cluster.pod_status("demo-rdzv", {"phase": "Running", "podIP": "127.0.0.9",
                                             "conditions": [{"type": "Ready", "status": "True"}]})
            for name in cluster.worker_names():
                cluster.run(name)
            assert cluster.kubelet is not None
            cluster.kubelet.dark.add("demo-rdzv")  # its kubelet confirms nothing
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
            assert (cluster.kube.get(store) or {}).get("metadata", {}).get("uid") == \
                old["metadata"]["uid"]  # just seen Ready: its silence is not yet its own
            at[0] = start + timedelta(seconds=15)
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
            assert cluster.kube.get(store) is None  # gone, not Terminating
            events = [e["message"] for e in cluster.events("StoreLost")]
            assert any("no trainer has heard the rendezvous store pod (on node "
                       f"{old['spec']['nodeName']}) for 12 s" in m for m in events), events
            assert reconcile_once(cluster.kube, cluster.ns, "demo", options) == "success"
            (other,) = set(pool_nodes) - {old["spec"]["nodeName"]}
            new = wait_for("the new store pod on the other node", lambda: (
                p if (p := cluster.kube.get(store) or {}).get("spec", {}).get("nodeName")
                else None))
            assert new["metadata"]["uid"] != old["metadata"]["uid"]
            assert new["spec"]["nodeName"] == other, new["spec"]
            cluster.kubelet.dark.discard("demo-rdzv")
        finally:
            members.close()
    status = cluster.status()
    assert (status.get("restarts", 0), status.get("preemptions", 0)) == (0, 0)
