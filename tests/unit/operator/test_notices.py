"""Notices acted on first (policy.notices): a worker on a node that gave notice moves
replacement first; in process the old pod leaves only once the new one is in the world's plan,
in Restart mode it stops with a save once the new one is bound to a node."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

from elastrain_operator.k8s.nodes import NodeNotices, read_notice_settings
from elastrain_operator.model import conditions as c
from elastrain_operator.policy.notices import DEFAULT_NOTICE_TAINTS, node_notice
from elastrain_operator.policy.progress import parse_progress

from .test_planning import T0, World

NOTICE = {"node-a": "taint karpenter.sh/disrupted"}


def member(members: list[str], spares: list[str]) -> Any:
    return parse_progress({"step": 40, "totalSteps": 100, "worldSize": len(members),
                           "role": "member", "lastStepTime": T0.isoformat(),
                           "members": members, "spares": spares})


def on_nodes(w: World) -> None:
    for i, name in enumerate(w.workers()):
        w.pods[name].setdefault("spec", {})["nodeName"] = "node-a" if i == 1 else "node-b"


def running_world(**spec: Any) -> World:
    w = World.new(replicas=3, minReplicas=2, maxReplicas=3, **spec)
    w.reconcile(T0)
    w.run_all()
    on_nodes(w)
    w.reconcile(T0 + timedelta(seconds=1))
    assert w.workers()[:3] == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
    return w


def test_a_noticed_worker_moves_replacement_first_and_leaves_once_it_joined() -> None:
    w = running_world(recovery={"mode": "InProcess"})
    now = T0 + timedelta(seconds=10)
    p = w.reconcile(now, notices=NOTICE)
    # The replacement exists before anything leaves, away from the doomed node; nothing counted.
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-1-1",
                           "demo-worker-2-0"]
    assert not p.delete_pods and not p.counted_restarts and not p.counted_preemptions
    # Kept off node-a by the signal itself (the taint's NoSchedule), not by an affinity that
    # would outlive the notice.
    assert "affinity" not in w.pods["demo-worker-1-1"]["spec"]
    (event,) = [e for e in p.events if e.reason == c.NODE_DISRUPTION_NOTICE]
    assert "node-a" in event.message and "karpenter.sh/disrupted" in event.message
    assert w.condition(c.NODE_DISRUPTION_NOTICE)["status"] == "True"
    # Scheduled and running, but not in the world's plan yet: the old pod trains on.
    w.run_all()
    world = ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
    p = w.reconcile(now + timedelta(seconds=1), notices=NOTICE,
                    progress=(member(world, []),))
    assert not p.delete_pods and "demo-worker-1-0" in w.workers()
    # In the plan as a spare: the old pod is deleted (its SIGTERM: a leave at the boundary).
    p = w.reconcile(now + timedelta(seconds=2), notices=NOTICE,
                    progress=(member(world, ["demo-worker-1-1"]),))
    assert p.delete_pods == ("demo-worker-1-0",)
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-1", "demo-worker-2-0"]
    # Gone: the move is over, nothing was counted, the job is exactly its size.
    w.release("demo-worker-1-0")
    p = w.reconcile(now + timedelta(seconds=3),
                    progress=(member(["demo-worker-0-0", "demo-worker-1-1",
                                      "demo-worker-2-0"], []),))
    status = w.status
    assert (status["restarts"], status["preemptions"]) == (0, 0)
    assert not any(s.get("movingFrom") for s in status["slots"])
    assert w.condition(c.NODE_DISRUPTION_NOTICE)["status"] == "False"
    assert not p.create and w.workers() == ["demo-worker-0-0", "demo-worker-1-1",
                                            "demo-worker-2-0"]


def test_an_unscheduled_replacement_moves_nothing() -> None:
    w = running_world(recovery={"mode": "InProcess"})
    for second in range(10, 40, 10):
        p = w.reconcile(T0 + timedelta(seconds=second), notices=NOTICE,
                        progress=(member(["demo-worker-0-0", "demo-worker-1-0",
                                          "demo-worker-2-0"], []),))
        assert not p.delete_pods
    assert w.pods["demo-worker-1-1"]["status"]["phase"] == "Pending"
    assert "demo-worker-1-0" in w.workers()
    assert w.status["restarts"] == 0 and w.status["preemptions"] == 0


def test_an_old_pod_drained_before_its_replacement_joined_is_counted_once() -> None:
    """The drain was quicker than the move (e2e scenario 7 drains every worker at once): the
    platform took the pod before the move was done, so it counts as a preemption, once (the
    world shrank, unless its trainer held its leave: inprocess.hold); its replacement exists."""
    w = running_world(recovery={"mode": "InProcess"})
    w.reconcile(T0 + timedelta(seconds=10), notices=NOTICE)
    w.set_pod("demo-worker-1-0", "Failed", exit_code=137, disruption="EvictionByEvictionAPI")
    p = w.reconcile(T0 + timedelta(seconds=11), notices=NOTICE)
    assert (p.counted_preemptions, p.counted_restarts) == (1, 0)
    assert p.delete_pods == ("demo-worker-1-0",)  # a stale pod now, cleaned up
    assert not p.create  # its replacement is already there
    assert not any(s.get("movingFrom") for s in w.status["slots"])
    (loss,) = w.status["recentLosses"]
    assert (loss["pod"], loss["kind"]) == ("demo-worker-1-0", "Preempted")
    p = w.reconcile(T0 + timedelta(seconds=12), notices=NOTICE)
    assert not p.counted_preemptions and w.status["preemptions"] == 1
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-1", "demo-worker-2-0"]


def test_nodes_without_notice_keep_todays_path() -> None:
    inproc = running_world(recovery={"mode": "InProcess"})
    p = inproc.reconcile(T0 + timedelta(seconds=10), notices={"node-c": "cordoned"})
    assert not p.create and not p.events
    assert not any(x["type"] == c.NODE_DISRUPTION_NOTICE
                   for x in inproc.status["conditions"])


def test_a_restart_mode_worker_moves_with_a_save_once_its_replacement_is_bound() -> None:
    w = running_world(recovery={"mode": "Restart"})
    now = T0 + timedelta(seconds=10)
    p = w.reconcile(now, notices=NOTICE)
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-1-1",
                           "demo-worker-2-0"]
    assert not p.delete_pods and not p.counted_restarts and not p.counted_preemptions
    (event,) = [e for e in p.events if e.reason == c.NODE_DISRUPTION_NOTICE]
    assert "stops with a save at a step boundary" in event.message
    # Not bound yet (the scheduler has not placed it, or cannot): the old pod trains on.
    p = w.reconcile(now + timedelta(seconds=1), notices=NOTICE)
    assert not p.delete_pods and w.condition(c.NODE_DISRUPTION_NOTICE)["status"] == "True"
    # Bound to another node: the old pod is deleted; its SIGTERM makes every worker save the
    # step and restart, the replacement's agent among them.
    w.pods["demo-worker-1-1"]["spec"]["nodeName"] = "node-b"
    p = w.reconcile(now + timedelta(seconds=2), notices=NOTICE)
    assert p.delete_pods == ("demo-worker-1-0",)
    w.release("demo-worker-1-0")
    w.run_all()
    p = w.reconcile(now + timedelta(seconds=3))
    status = w.status
    assert (status["restarts"], status["preemptions"]) == (0, 0)
    assert not any(s.get("movingFrom") for s in status["slots"])
    assert w.condition(c.NODE_DISRUPTION_NOTICE)["status"] == "False"
    assert not p.create and w.workers() == ["demo-worker-0-0", "demo-worker-1-1",
                                            "demo-worker-2-0"]


def test_a_node_says_it_goes_by_a_listed_taint_or_a_cordon() -> None:
    taint = {"spec": {"taints": [{"key": "other", "effect": "NoSchedule"},
                                 {"key": "karpenter.sh/disruption", "value": "disrupting",
                                  "effect": "NoSchedule"}]}}
    assert node_notice(taint, DEFAULT_NOTICE_TAINTS) == \
        "taint karpenter.sh/disruption=disrupting"
    assert node_notice(taint, ["gke/x"]) is None  # the chart's list replaces the default
    assert node_notice({"spec": {"unschedulable": True}}, ()) == "cordoned"
    assert node_notice({"spec": {}}, DEFAULT_NOTICE_TAINTS) is None
    assert node_notice({}, DEFAULT_NOTICE_TAINTS) is None


def test_an_operator_that_may_not_read_nodes_says_so_on_every_job() -> None:
    for mode in ("InProcess", "Restart"):
        w = running_world(recovery={"mode": mode})
        w.reconcile(T0 + timedelta(seconds=10),
                    notices_off="the operator may not list nodes (403)")
        cond = w.condition(c.NODE_DISRUPTION_NOTICE)
        assert (cond["status"], cond["reason"]) == ("False", c.NOTICES_OFF), mode
        assert "may not list nodes" in cond["message"]


def test_the_watch_keeps_only_nodes_with_a_notice_and_reports_changes() -> None:
    notices = NodeNotices(DEFAULT_NOTICE_TAINTS)
    quiet = {"metadata": {"name": "n1"}, "spec": {}}
    cordoned = {"metadata": {"name": "n1"}, "spec": {"unschedulable": True}}
    assert not notices.put(quiet)
    assert notices.put(cordoned) and not notices.put(cordoned)
    assert notices.of(["n1", "n2"]) == {"n1": "cordoned"}
    assert notices.put(quiet) and notices.of(["n1"]) == {}
    assert notices.put(cordoned) and notices.remove("n1") and notices.of(["n1"]) == {}


def test_the_settings_name_the_variable_that_is_wrong() -> None:
    assert read_notice_settings({}) == DEFAULT_NOTICE_TAINTS
    assert read_notice_settings({"ELASTRAIN_NODE_NOTICES": "false"}) is None
    assert read_notice_settings({"ELASTRAIN_NOTICE_TAINTS": "a.example/x, b"}) == (
        "a.example/x", "b")
    for env, var in (({"ELASTRAIN_NODE_NOTICES": "yes"}, "ELASTRAIN_NODE_NOTICES"),
                     ({"ELASTRAIN_NOTICE_TAINTS": "a b/c"}, "ELASTRAIN_NOTICE_TAINTS")):
        try:
            read_notice_settings(env)
        except ValueError as err:
            assert var in str(err)
        else:
            raise AssertionError(env)


def test_a_notice_withdrawn_before_the_replacement_joined_undoes_the_move() -> None:
    w = running_world(recovery={"mode": "InProcess"})
    w.reconcile(T0 + timedelta(seconds=10), notices=NOTICE)
    assert "demo-worker-1-1" in w.workers()
    new = copy.deepcopy(w.pods["demo-worker-1-1"])
    p = w.reconcile(T0 + timedelta(seconds=11))  # the taint is gone
    assert p.delete_pods == ("demo-worker-1-1",)
    assert any("withdrawn" in e.message for e in p.events)
    # Its finalizer released, it terminates until its kubelet confirms: in the next rounds
    # that is neither a lost status write (a newer attempt to trust) nor a loss.
    new["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z", finalizers=[])
    w.pods["demo-worker-1-1"] = new
    for second in (12, 13):
        p = w.reconcile(T0 + timedelta(seconds=second))
        assert not p.create and not p.counted_preemptions and not p.counted_restarts
    del w.pods["demo-worker-1-1"]
    w.reconcile(T0 + timedelta(seconds=14))
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
    assert (w.status["restarts"], w.status["preemptions"]) == (0, 0)
    assert [s["attempt"] for s in w.status["slots"]] == [0, 0, 0]
    assert w.condition(c.NODE_DISRUPTION_NOTICE)["status"] == "False"


def test_a_pod_made_while_a_node_is_cordoned_is_left_to_the_scheduler() -> None:
    """No pod excludes a noticed node: a pod of a Restart-mode job made during a drain must run
    on that node once it is uncordoned (a one-node cluster; e2e scenario 7 once left such pods
    Pending)."""
    w = running_world(recovery={"mode": "Restart"})
    w.set_pod("demo-worker-1-0", "Failed", exit_code=137, disruption="EvictionByEvictionAPI")
    p = w.reconcile(T0 + timedelta(seconds=10), notices={"node-a": "cordoned"})
    (created,) = [m for m in p.create if m["kind"] == "Pod"]
    assert created["metadata"]["name"] == "demo-worker-1-1"
    assert "affinity" not in created["spec"]


def test_a_moving_slot_counts_its_old_pod_until_the_replacement_runs() -> None:
    """e2e scenario 15 (InProcess): the node cordoned, every replacement Pending: the job still
    trains with its old pods, and its status says so (readyReplicas 3, not 0)."""
    w = running_world(recovery={"mode": "InProcess"})
    for name in w.workers():
        w.pods[name]["spec"]["nodeName"] = "node-a"
    w.reconcile(T0 + timedelta(seconds=10), notices={"node-a": "cordoned"})
    assert len(w.workers()) == 6
    assert (w.status["replicas"], w.status["readyReplicas"], w.status["phase"]) == (
        3, 3, "Running")


def test_a_waiting_spare_takes_a_noticed_workers_place_at_once_and_serves_one_move() -> None:
    """spec.spares: a spare already waits, so a noticed worker need not wait for its own
    replacement to join: it is asked to leave in the next round (the spare takes its place at
    that boundary; the replacement becomes the spare). Two noticed workers and one spare: only
    one leaves early, the other waits for its replacement as without spares; a spare on the
    noticed node takes nobody's place."""
    w = running_world(recovery={"mode": "InProcess"}, spares=1)
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0",
                           "demo-worker-3-0"]
    w.pods["demo-worker-2-0"]["spec"]["nodeName"] = "node-a"  # workers 1 and 2 on node-a
    members = ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"]
    w.reconcile(T0 + timedelta(seconds=10), notices=NOTICE,
                progress=(member(members, ["demo-worker-3-0"]),))
    assert {"demo-worker-1-1", "demo-worker-2-1"} <= set(w.workers())
    p = w.reconcile(T0 + timedelta(seconds=11), notices=NOTICE,
                    progress=(member(members, ["demo-worker-3-0"]),))
    assert p.delete_pods == ("demo-worker-1-0",)  # neither replacement has joined
    (event,) = [e for e in p.events if e.reason == c.NODE_DISRUPTION_NOTICE]
    assert "spare pod demo-worker-3-0 takes the place of pod demo-worker-1-0" in event.message
    # Still in the world (its leave not yet at a boundary): the spare is spoken for.
    w.pods["demo-worker-1-0"] = {**w.pods["demo-worker-1-0"], "metadata": {
        **w.pods["demo-worker-1-0"]["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    p = w.reconcile(T0 + timedelta(seconds=12), notices=NOTICE,
                    progress=(member(members, ["demo-worker-3-0"]),))
    assert not p.delete_pods
    # A spare on the noticed node itself takes nobody's place.
    w2 = running_world(recovery={"mode": "InProcess"}, spares=1)
    w2.pods["demo-worker-3-0"]["spec"]["nodeName"] = "node-a"
    w2.reconcile(T0 + timedelta(seconds=10), notices=NOTICE,
                 progress=(member(members, ["demo-worker-3-0"]),))
    p = w2.reconcile(T0 + timedelta(seconds=11), notices=NOTICE,
                     progress=(member(members, ["demo-worker-3-0"]),))
    assert "demo-worker-1-0" not in p.delete_pods
