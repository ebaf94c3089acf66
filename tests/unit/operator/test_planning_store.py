"""plan() with a rendezvous store that never works: told, not counted, paced, and bounded."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from elastrain_operator.describe import describe_job
from elastrain_operator.model import conditions as c
from elastrain_operator.policy.progress import parse_progress
from tests.unit.operator.test_planning import T0, World

LOST = ("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to "
        "the C10d store has failed. See inner exception for details.")
PULL = {"containerStatuses": [{"name": "rdzv-store", "restartCount": 0, "state": {"waiting": {
    "reason": "ImagePullBackOff", "message": 'Back-off pulling image "store:nope"'}}}]}


def at(seconds: float) -> Any:
    return T0 + timedelta(seconds=seconds)


def broken_store(**spec: Any) -> World:
    """Workers running, the store pod stuck pulling an image that does not exist."""
    w = World.new(**spec)
    w.reconcile(at(0))
    w.pods["demo-rdzv"]["status"] = {"phase": "Pending", **PULL}
    for name in w.workers():
        w.set_pod(name, "Running")
    w.reconcile(at(1))
    return w


def test_a_store_that_never_becomes_ready_is_a_condition_with_the_kubelets_reason() -> None:
    w = broken_store()
    cond = w.condition(c.RENDEZVOUS_STORE_READY)
    assert (cond["status"], cond["reason"]) == ("False", c.STORE_IMAGE_PULL_FAILED)
    assert cond["message"] == 'ImagePullBackOff: Back-off pulling image "store:nope"'
    assert w.status["rendezvousStore"] == {"uid": "demo-rdzv-1", "created": "2026-01-01T00:00:00Z",
                                           "workersLost": 0}
    text = describe_job(w.job, list(w.pods.values()))
    assert ("Rendezvous store: demo-rdzv Pending on unscheduled: not Ready, "
            "StoreImagePullFailed: ImagePullBackOff") in text
    assert "  RendezvousStoreReady=False StoreImagePullFailed: ImagePullBackOff" in text


def test_workers_lost_to_it_are_not_preemptions_and_are_paced() -> None:
    w = broken_store(restartPolicy={"backoffSeconds": 10, "maxBackoffSeconds": 300})
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1, message=LOST)
    w.set_pod("demo-worker-1-0", "Failed", exit_code=1, message=LOST)
    p = w.reconcile(at(90))
    assert (w.status["preemptions"], w.status["restarts"]) == (0, 0)
    assert p.counted_preemptions == p.counted_restarts == 0 and p.create == ()
    told = [e for e in p.events if "lost the rendezvous store demo-rdzv" in e.message]
    assert [e.reason for e in told] == [c.WAITING_FOR_STORE] * 2, p.events
    assert "not counted as a preemption; replaced after 2026-01-01T00:01:" in told[0].message
    assert w.status["rendezvousStore"]["workersLost"] == 2
    assert w.status["rendezvousStore"]["replaceAfter"] == "2026-01-01T00:01:50Z"  # 90 + 20
    assert w.condition(c.ALL_WORKERS_RUNNING)["reason"] == c.WAITING_FOR_STORE
    assert w.reconcile(at(109)).create == ()
    created = w.reconcile(at(110)).create
    assert sorted(m["metadata"]["name"] for m in created) == ["demo-worker-0-1", "demo-worker-1-1"]
    text = describe_job(w.job, list(w.pods.values()))
    assert "(2 worker(s) lost to it, not counted)" in text


def test_after_the_bound_the_job_fails_naming_the_store() -> None:
    w = broken_store(rendezvous={"store": {"readyTimeoutSeconds": 120}})
    assert w.reconcile(at(119)).status.phase != "Failed"
    p = w.reconcile(at(120))
    assert w.status["phase"] == "Failed"
    failed = w.condition(c.FAILED)
    assert failed["reason"] == c.RENDEZVOUS_STORE_NOT_READY
    assert failed["message"].startswith(
        "the rendezvous store pod demo-rdzv was not Ready within "
        "spec.rendezvous.store.readyTimeoutSeconds (120); StoreImagePullFailed: ")
    assert c.RENDEZVOUS_STORE_NOT_READY in [e.reason for e in p.events]
    assert "demo-rdzv" in p.delete_pods
    # Terminal: the condition keeps telling why.
    w.reconcile(at(121))
    assert w.condition(c.RENDEZVOUS_STORE_READY)["reason"] == c.STORE_IMAGE_PULL_FAILED


def test_a_store_that_becomes_ready_later_clears_and_releases_the_waiting_workers() -> None:
    w = broken_store(restartPolicy={"backoffSeconds": 300, "maxBackoffSeconds": 300},
                     rendezvous={"store": {"readyTimeoutSeconds": 600}})
    w.set_pod("demo-worker-1-0", "Failed", exit_code=1, message=LOST)
    assert w.reconcile(at(60)).create == ()
    w.pods["demo-rdzv"]["status"] = {"phase": "Running",
                                     "conditions": [{"type": "Ready", "status": "True"}]}
    p = w.reconcile(at(61))
    assert [m["metadata"]["name"] for m in p.create] == ["demo-worker-1-1"]
    cond = w.condition(c.RENDEZVOUS_STORE_READY)
    assert (cond["status"], cond["reason"]) == ("True", c.STORE_READY)
    assert any(e.reason == c.STORE_READY for e in p.events)
    assert w.status["rendezvousStore"]["readyAt"] == "2026-01-01T00:01:01Z"
    # Past the bound, a store that was Ready once never fails the job.
    w.pods["demo-rdzv"]["status"] = {"phase": "Running", **PULL}
    w.reconcile(at(900))
    assert w.status["phase"] != "Failed"
    # Losing a store that was Ready is the platform's loss: a preemption, as before.
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1, message=LOST)
    w.reconcile(at(901))
    assert w.status["preemptions"] == 1


def test_a_worker_that_knew_the_previous_store_is_preempted_by_its_loss() -> None:
    """The store pod was deleted: its replacement is not Ready yet when the workers that used
    the old one exit; they lost a working store, so they count as preemptions."""
    w = World.new()
    w.reconcile(at(0))
    w.run_all()
    w.reconcile(at(1))
    del w.pods["demo-rdzv"]
    w.reconcile(at(20))  # recreated
    w.reconcile(at(21))  # seen: a new attempt, never Ready yet
    assert w.status["rendezvousStore"]["uid"] != "demo-rdzv-1"
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1, message=LOST)
    w.reconcile(at(22))
    assert (w.status["preemptions"], w.status["rendezvousStore"]["workersLost"]) == (1, 0)


def test_suspend_forgets_the_store_attempt() -> None:
    w = broken_store(rendezvous={"store": {"readyTimeoutSeconds": 60}})
    w.job["spec"]["suspend"] = True
    w.reconcile(at(30))
    assert "rendezvousStore" not in w.status
    assert w.condition(c.RENDEZVOUS_STORE_READY)["reason"] == c.JOB_SUSPENDED
    w.reconcile(at(300))
    assert w.status["phase"] == "Suspended"


def test_a_store_pod_on_a_lost_node_is_force_deleted_and_created_again_at_once() -> None:
    """Issue 34: the node hosting the store pod goes NotReady (its kubelet gone): the pod would
    stay Running for its node-loss toleration, then Terminating until the node answers. The
    operator force-deletes it as soon as its Node watch says the node is lost and creates it
    again in the next round; nothing is counted, the workers keep running."""
    w = store_running_on("node-a", mode="InProcess")
    assert not w.reconcile(at(1)).force_delete_pods
    lost = {"node-a": "Ready=Unknown (NodeStatusUnknown)"}
    p = w.reconcile(at(2), lost_nodes=lost)
    assert p.force_delete_pods == ("demo-rdzv",) and not p.delete_pods
    (event,) = [e for e in p.events if e.reason == c.STORE_LOST]
    assert "node-a is lost (Ready=Unknown (NodeStatusUnknown))" in event.message
    assert (w.status["preemptions"], w.status["restarts"]) == (0, 0)
    p = w.reconcile(at(3), lost_nodes=lost)
    assert [m["metadata"]["name"] for m in p.create] == ["demo-rdzv"]
    assert not p.force_delete_pods and len(w.workers()) == 2


def unheard(seconds: float | None, step: int = 5) -> Any:
    """A member's /progress saying how long its heartbeat has not heard the store."""
    doc: dict[str, Any] = {"step": step, "worldSize": 2, "role": "member"}
    if seconds is not None:
        doc["storeUnansweredSeconds"] = seconds
    report = parse_progress(doc)
    assert report is not None and report.store_unanswered_s == seconds
    return report


def store_running_on(node: str, **recovery: Any) -> World:
    """The job's pods made at 0 s, its store Ready on `node` and its workers running, not yet
    observed so."""
    w = World.new(recovery=recovery)
    w.reconcile(at(0))
    w.pods["demo-rdzv"]["spec"]["nodeName"] = node
    w.pods["demo-rdzv"]["status"] = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}
    for name in w.workers():
        w.set_pod(name, "Running")
    return w


def ready_store_world() -> World:
    w = store_running_on("node-b", mode="InProcess", heartbeatTimeoutSeconds=5)
    w.reconcile(at(1))  # the store seen Ready at 1 s
    return w


def test_a_store_no_trainer_hears_is_replaced_before_its_node_is_lost_and_kept_off_it() -> None:
    """Issue 34: the store's node dark but still Ready (the node controller's grace), or its
    process frozen: every trainer polled reports it has not heard the store for two heartbeat
    timeouts, so the operator force-deletes it at once and its next pod prefers another node.
    Not sooner, not on one trainer's word while another hears it, not for a trainer that
    reports nothing (an older image), and not for a new store the trainers have not found
    yet."""
    w = ready_store_world()
    assert not w.reconcile(at(30), progress=(unheard(9.9), unheard(12.0))).force_delete_pods
    assert not w.reconcile(at(31), progress=(unheard(11.0), unheard(0.4))).force_delete_pods
    assert not w.reconcile(at(32), progress=(unheard(11.0), unheard(None))).force_delete_pods
    assert not w.reconcile(at(33), progress=()).force_delete_pods
    p = w.reconcile(at(34), progress=(unheard(10.2), unheard(10.6)))
    assert p.force_delete_pods == ("demo-rdzv",) and not p.delete_pods
    (event,) = [e for e in p.events if e.reason == c.STORE_LOST]
    assert "no trainer has heard the rendezvous store pod (on node node-b) for 10 s" \
        in event.message, event.message
    assert (w.status["preemptions"], w.status["restarts"]) == (0, 0)
    assert w.status["rendezvousStore"]["unheardOn"] == "node-b"
    created = w.reconcile(at(35)).create
    (store,) = [m for m in created if m["metadata"]["name"] == "demo-rdzv"]
    assert store["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"] == {
        "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-b"]}]}
    # The new store: Ready at 40 s; the trainers' silence still counts from the old one's, but
    # the new pod is judged from its own readiness only.
    w.pods["demo-rdzv"]["spec"]["nodeName"] = "node-a"
    w.pods["demo-rdzv"]["status"] = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}
    w.reconcile(at(40))
    assert "unheardOn" not in w.status["rendezvousStore"]
    assert not w.reconcile(at(45), progress=(unheard(20.0), unheard(20.0))).force_delete_pods
    assert w.reconcile(at(50), progress=(unheard(30.0), unheard(30.0))).force_delete_pods == (
        "demo-rdzv",)


def test_a_restart_mode_jobs_store_is_never_replaced_on_reports() -> None:
    """Torchrun agents report no store silence; a report that did would change nothing for
    them (their rendezvous store's loss restarts the group anyway)."""
    w = store_running_on("node-b", mode="Restart")
    w.reconcile(at(1))
    assert not w.reconcile(at(60), progress=(unheard(50.0), unheard(50.0))).force_delete_pods
