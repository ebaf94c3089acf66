"""Issue 34 on two real nodes (tests/e2e/two_nodes.py): a worker's node lost while its process
runs on, and a notice acted on first. One InProcess job (the e2e job: 3 workers, min 2; its
store pinned to node 1), its worker 2 placed on node 2, the others on node 1.

1. Node 2's kubelet and containerd stopped: its containers run on, so the worker there still
   beats and trains in the world, and no heartbeat plans it out. Once its Node is NotReady the
   operator tells the members it is lost (`POST /control`'s "lost"); they ask it to leave at a
   step boundary, it takes part and ends (its processes gone from the node, with no kubelet to
   stop them), and the operator counts it once as a failure, force-deletes the pod and creates
   its replacement on node 1 at once: not after the pods' node-loss toleration (the taint
   manager's eviction), nor the 300 s Kubernetes gives by default. The
   orphan never trains beside the world: nothing in the bucket was committed by its generation
   after the world moved on, `latest` names the world's newest commit. Node 2's runtime is
   started again at the end: nothing of the orphan comes back, nothing more is counted.
2. Node 2 tainted `karpenter.sh/disrupted:NoSchedule`: the operator starts the move (worker 2's
   replacement created first, on node 1, to arrive as a spare), and node 2 is drained through
   the Eviction API right then, as Karpenter does within seconds of its taint, before the
   replacement has started. The doomed trainer, told it moves, trains on after its SIGTERM
   until the replacement waits to take its place, then leaves: every step the trainers record
   after the taint is at world 3, none is trained twice, one preemption (the drain took the pod
   before the move was done), no failure.
3. Node 2, with worker 2 and the operator on it, partitioned (every packet to and from it
   dropped: no socket closes): the heartbeat plans its worker out with no operator to help; the
   chart's tolerations (30 s on a NotReady or unreachable node) let the operator's Deployment
   start it on node 1, and the new operator replaces the dark worker (a failure, counted once).
   Once the partition lifts the old operator is ended by its kubelet, counting nothing twice,
   and the dark worker ends without training beside the world: the store's plan never names
   it again, and the bucket holds no commit of its generation made after the world moved on.
4. Node 2 cordoned, with a spare waiting on node 1, and drained once the move is done: the
   doomed worker leaves at once and the spare takes its place; its replacement becomes the new
   spare; the drain finds none of the job's pods there. Nothing counted.
5. The job's store moved to node 2 (its node label moved, its pod deleted: the world reclaims the
   new one), then node 2 partitioned: the world trains on without the store; no trainer hears
   it, so the operator force-deletes the store pod (node 2 may still read Ready) and creates it
   on node 1, and the world reclaims it. Nothing counted, no step redone.
6. Worker 2 and the store both on node 2, then node 2 partitioned: the store is replaced the
   same way, a survivor restores the world's generation into the new one, and the heartbeat
   plans the dark worker out there; it is replaced (a failure) and fenced once the partition
   lifts.

Scenario 19 (issue 34, items 2 and 4), run after 1 on this job, already up (a job of its own
cost ~20-25 s of the issue's 10 minutes, and scenario 2 a scale down and up to put worker 2 back
on node 2): a worker that goes dark. Every process of one worker pod's trainer container on
node 1 is stopped (SIGSTOP: no heartbeat and no socket closed, what peers see of a hung host or
of a partition, without the kernel's RST a killed process gets). The survivors' gloo all-reduce
would wait out its timeout (5 minutes); instead the heartbeat judges the pod gone within
heartbeatTimeoutSeconds and each survivor severs its own sockets of that generation
(docs/recovery.md section 8): they train on at world 2 in their processes, redoing at most the
step in flight. Then the pod thaws, as a partition lifts: its own collective fails on the reset
sockets, it finds itself planned out, restarts its worker in place and rejoins healed from a
live peer; the world is whole again without a new pod. A second worker then stays frozen: past
the grace (policy.replace) the operator replaces it and its replacement joins, counted once as a
failure; after scenario 1 that is worker 2 (moved to node 1), and its replacement is placed on
node 2, where scenario 2 wants it. (Scenario 19r, the Restart-mode freeze, runs on
test_node_notice_restart.py's job.)
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import NamespacePool, NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    Incarnation,
    Training,
    container_pid,
    event_reasons,
    first_step_after_change,
    process_tree,
    record_recovery,
    signal_all,
    steps_retrained,
    wait_for,
)
from tests.e2e.two_nodes import (
    KARPENTER,
    NODE_1,
    TwoNodeJob,
    commits,
    ended_after_heal,
    job_on_two_nodes,
    node_ready,
    pod_processes,
    settled_commits,
)

JOB = "nodeloss"


@pytest.fixture(scope="module")
def two(operator: NodeCluster, namespace_pool: NamespacePool) -> Iterator[TwoNodeJob]:
    """The module's InProcess job on the two nodes (two_nodes.job_on_two_nodes)."""
    with job_on_two_nodes(operator, namespace_pool, JOB, INPROCESS) as t:
        yield t


def test_1_a_node_whose_runtime_stopped_is_planned_out_then_replaced_on_node_1(
        two: TwoNodeJob) -> None:
    t = two
    t.settle()
    before = t.counters()
    (orphan,) = [p for p in t.workers() if p["spec"].get("nodeName") == t.second.name]
    name, uid = orphan["metadata"]["name"], orphan["metadata"]["uid"]
    survivors = t.survivors()
    assert len(survivors) == 2 and pod_processes(uid), (survivors, name)
    at = time.time()
    t.second.stop_runtime()
    try:
        assert pod_processes(uid), "the orphan's processes stopped with its runtime"
        leave = wait_for("the world without the orphan", lambda: next(
            (r for r in t.logs.events("regroup")
             if float(r["time"]) > at and r["world_size"] == 2), None), timeout=180)
        # A leave, not a failure: the orphan was alive and took part in the step boundary.
        assert leave["reason"] == "leave", leave
        told = {r["leaver"] for r in t.logs.events("lost_node_leave") if float(r["time"]) > at}
        assert told == {name}, told
        assert not node_ready(t, t.second.name)
        wait_for("the orphan's processes ended", lambda: not pod_processes(uid), timeout=60)
        replacement = wait_for("worker 2's replacement bound to node 1",
                               lambda: t.bound(2, NODE_1), timeout=60)
        joined = wait_for("the replacement in the world, healed from a peer", lambda: next(
            (r for r in t.logs.events("regroup") if float(r["time"]) > at
             and r.get("node") == replacement and r.get("healed_from")
             and r["world_size"] == 3), None), timeout=180)
        # Counted once, as a failure (no notice), by the operator's word: not by the taint
        # manager's eviction after the pods' toleration.
        assert t.counters() == (before[0], before[1] + 1)
        loss = t.status()["recentLosses"][-1]
        assert (loss["pod"], loss["kind"]) == (name, "Failed"), loss
        assert "DeletionByTaintManager" not in loss["reason"], loss
        assert loss["reason"].startswith(f"node {t.second.name} lost"), loss
        assert "WorkerFailed" in event_reasons(t.k, t.ns, t.job)
        # Force-deleted, while node 2 is still NotReady.
        assert t.k("get", "pod", name, "-n", t.ns, check=False).returncode != 0
        assert not node_ready(t, t.second.name)
        assert steps_retrained(t.logs, at) == 0
        assert {n: t.survivors().get(n) for n in survivors} == survivors, \
            "a survivor's trainer process was restarted"
        record_recovery("34-runtime-stopped", float(joined["time"]) - at, mode=INPROCESS,
                        pod=name, world_2_after_s=round(float(leave["time"]) - at, 1))
        print(f"{name}: runtime stopped; world 2 after {float(leave['time']) - at:.1f} s, "
              f"{replacement} in the world after {float(joined['time']) - at:.1f} s")
    finally:
        t.second.start_runtime()
    # The runtime back: nothing of the orphan returns, nothing more is counted.
    mark = time.time()
    wait_for("a step at world 3 after the runtime came back", lambda: [
        r for r in t.logs.events("step") if float(r["time"]) > mark
        and r["world_size"] == 3], timeout=60)
    assert t.bound(2, t.second.name) is None and not pod_processes(uid)
    assert t.counters() == (before[0], before[1] + 1)
    # Fenced: the world commits on (its generation at least the leave's); no commit of an
    # older generation came after the leave, none was fenced, and `latest` is the world's.
    wait_for("a commit of the world after the join", lambda: [
        c for c in commits(t.node, t.ns, t.job)[0]
        if not c["fenced"] and c["gen"] >= int(joined["gen"])], timeout=120)
    made, latest, newest = settled_commits(t.node, t.ns, t.job)
    assert not [c for c in made if c["fenced"]], made
    stale = [c for c in made if c["gen"] < int(leave["gen"]) and c["at"] > float(leave["time"])]
    assert not stale, stale
    assert latest == newest["dir"] and newest["gen"] >= int(leave["gen"]), (latest, newest)


def test_19_a_frozen_worker_is_planned_out_by_the_heartbeat_and_rejoins_when_it_thaws(
        two: TwoNodeJob) -> None:
    t = two
    t.settle()
    # Frozen on node 1, whose containerd names their processes (t.survivors reads them there).
    pod = t.worker(1)
    processes = t.survivors()
    uid = processes[pod].uid
    others = {p["metadata"]["name"] for p in t.workers()} - {pod}
    frozen = process_tree(container_pid(t.k, t.ns, pod))
    at = time.time()
    signal_all(frozen, signal.SIGSTOP)
    try:
        # Far below the collective timeout (300 s): only the heartbeat's path is this fast.
        first = wait_for("a step at world 2", lambda: first_step_after_change(t.logs, at),
                         timeout=60)
        recovery_s = float(first["time"]) - at
        assert first["world_size"] == 2, first
        fails = [r for r in t.logs.events("regroup")
                 if float(r["time"]) > at and r["reason"] == "fail"]
        assert fails and fails[0]["world_size"] == 2, fails
        survivors = {n: inc for n, inc in processes.items() if n != pod}
        now = t.survivors()
        assert {n: now.get(n) for n in survivors} == survivors, \
            "a survivor's trainer process was restarted"
        assert steps_retrained(t.logs, at) <= 1
    finally:
        signal_all(frozen, signal.SIGCONT)
    thawed = time.time()
    joined = wait_for("the thawed node back in the world, healed from a peer", lambda: next(
        (r for r in t.logs.events("regroup") if float(r["time"]) > thawed
         and r.get("healed_from") and r["world_size"] == 3), None), timeout=180)
    whole = wait_for("a step at world 3 after the join", lambda: next(
        (r for r in t.logs.events("step") if float(r["time"]) > float(joined["time"])
         and r.get("world_size") == 3), None), timeout=120)
    # It announced its rejoin before its restart, and the survivors saw it (so the operator gave
    # it time: policy.replace); the same pod came back (its worker restarted in place), never a
    # checkpoint load.
    assert {r["node"] for r in t.logs.events("peer_rejoining") if r["peer"] == pod
            and float(r["time"]) > thawed - 1} == others, t.logs.events("peer_rejoining")
    assert t.survivors()[pod].uid == uid
    assert not [r for r in t.logs.events("resumed") if float(r["time"]) > at]
    record_recovery("19-frozen-worker", recovery_s, mode=INPROCESS, pod=pod,
                    frozen_s=round(thawed - at, 2),
                    whole_after_thaw_s=round(float(whole["time"]) - thawed, 2))
    print(f"{pod} frozen: world 2 after {recovery_s:.2f} s; thawed after "
          f"{thawed - at:.2f} s; world 3 again {float(whole['time']) - thawed:.2f} s later")

    # A worker that stays dark: the world plans it out as above, and the operator, told so by
    # the members' control answers (plannedOut), replaces it (issue 34 item 4): counted once as
    # a failure, the old pod deleted, the world whole again with a new pod. After scenario 1
    # worker 2 is on node 1, and with node 1 held its replacement goes to node 2, where
    # scenario 2 wants it (that saves scenario 2 a scale down and up). Run alone: worker 1 again,
    # replaced on node 1.
    index = 2 if t.node_of(t.worker(2)) == NODE_1 else 1
    home, held = (t.second.name, NODE_1) if index == 2 else (NODE_1, t.second.name)
    dark = t.worker(index)
    before = t.counters()
    frozen = process_tree(container_pid(t.k, t.ns, dark))
    t.hold(held)
    at = time.time()
    signal_all(frozen, signal.SIGSTOP)
    try:
        replacement = wait_for(f"worker {index}'s replacement pod", lambda: next(
            (p["metadata"]["name"] for p in t.pods_of(index) if p["metadata"]["name"] != dark),
            None), timeout=120)
        replaced_s = time.time() - at
        wait_for(f"the replacement bound to {home}", lambda: t.node_of(replacement) == home,
                 timeout=60)
    finally:
        signal_all(frozen, signal.SIGCONT)  # the pod is being deleted: let it go
        t.release(held)
    back = wait_for("the replacement in the world, healed from a peer", lambda: next(
        (r for r in t.logs.events("regroup") if float(r["time"]) > at
         and r.get("node") == replacement and r["world_size"] == 3), None), timeout=180)
    assert t.counters() == (before[0], before[1] + 1)
    loss = t.status()["recentLosses"][-1]
    assert (loss["pod"], loss["kind"]) == (dark, "Failed"), loss
    assert loss["reason"].startswith("planned out by the in-process world"), loss
    print(f"{dark} stayed dark: replaced by {replacement} on {home} after {replaced_s:.1f} s, "
          f"world 3 again {float(back['time']) - at:.1f} s after it froze")
    record_recovery("19-dark-worker-replaced", float(back["time"]) - at, mode=INPROCESS,
                    pod=dark, replaced_after_s=round(replaced_s, 1))


def notice_condition(t: TwoNodeJob) -> dict[str, Any] | None:
    return next((c for c in t.status().get("conditions", [])
                 if c["type"] == "NodeDisruptionNotice" and c["status"] == "True"), None)


def survivors_pause(t: TwoNodeJob, at: float) -> dict[str, float]:
    """The survivors' pause at each regroup since `at`, as their coordinator timed it (the
    regroup and the heal of whoever joined): the notice-first move's cost to training."""
    pauses = [round(float(r.get("regroup_s", 0)) + float(r.get("heal_s", 0)), 3)
              for r in t.logs.events("regroup") if float(r["time"]) > at
              and r.get("healed_from") is None and r.get("regroup_s") is not None]
    return {"pause_s": max(pauses, default=0.0), "regroups": len(pauses)}


def test_2_a_karpenter_notice_then_a_drain_keeps_the_world_at_full_size(two: TwoNodeJob) -> None:
    t = two
    t.settle()
    if t.node_of(t.worker(2)) != t.second.name:  # scenario 19 did not put it back (run alone)
        t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=2")
        t.settle(replicas=2)
        t.put_worker_2_on_node_2()
    doomed = t.worker(2)
    before = t.counters()
    survivors = t.survivors()
    at = time.time()
    t.k("taint", "node", t.second.name, f"{KARPENTER}=:NoSchedule", "--overwrite")
    try:
        _notice_then_drain(t, doomed, before, survivors, at)
    finally:
        t.k("taint", "node", t.second.name, f"{KARPENTER}:NoSchedule-", check=False)
        t.k("uncordon", t.second.name)


def _notice_then_drain(t: TwoNodeJob, doomed: str, before: tuple[int, int],
                       survivors: dict[str, Incarnation], at: float) -> None:
    # The operator starts the move (a replacement created first, not counted), then the drain
    # comes at once through the Eviction API (kubectl drain evicts, after its own cordon), as
    # Karpenter's within seconds of its taint: before the replacement has even started.
    cond = wait_for("the move started", lambda: notice_condition(t), timeout=60)
    assert t.second.name in cond["message"] and KARPENTER in cond["message"], cond
    t.k("drain", t.second.name, "--pod-selector", Training.worker_selector(t.job),
        "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=180s", timeout=240)
    drained = time.time()
    wait_for("the doomed pod gone", lambda: t.k(
        "get", "pod", doomed, "-n", t.ns, check=False).returncode != 0, timeout=180)
    replacement = wait_for("worker 2's replacement on node 1", lambda: t.bound(2, NODE_1))
    joined = wait_for("the replacement in the world, healed from a peer", lambda: next(
        (r for r in t.logs.events("regroup") if float(r["time"]) > at
         and r.get("node") == replacement and r.get("healed_from")), None), timeout=60)
    # The doomed trainer, signalled before its replacement joined, trained on until it had
    # (inprocess.hold), then left at a step boundary.
    held = [r for r in t.logs.events("leave_hold_ended") if r["pod"] == doomed]
    assert [r["reason"] for r in held] == ["replaced"], held
    (left,) = [r for r in t.logs.events("left") if r["pod"] == doomed]
    mark = time.time()
    wait_for("20 steps after the move", lambda: len(
        [r for r in t.logs.events("step") if float(r["time"]) > mark]) >= 20, timeout=120)
    # Every step the trainers recorded since the taint: at world 3, none trained twice.
    steps = [r for r in t.logs.events("step") if float(r["time"]) > at]
    assert {r["world_size"] for r in steps} == {3}, sorted({r["world_size"] for r in steps})
    assert steps_retrained(t.logs, at) == 0
    assert joined["world_size"] == 3 and left["step"] > 0
    # The drain took the pod before the move was done: counted once as a preemption
    # (policy.notices), never as a failure.
    wait_for("the drain counted", lambda: t.counters()[0] == before[0] + 1)
    assert t.counters() == (before[0] + 1, before[1])
    assert {n: t.survivors().get(n) for n in survivors} == survivors, \
        "a survivor's trainer process was restarted"
    record_recovery("34-notice-then-drain", float(joined["time"]) - at, mode=INPROCESS,
                    pod=doomed, drain_done_s=round(drained - at, 1),
                    held_s=held[0].get("waited_s"), **survivors_pause(t, at))
    print(f"{doomed} moved off {t.second.name} by {replacement}: the drain done "
          f"{drained - at:.1f} s after the taint, the leave held {held[0].get('waited_s')} s")


# Read in a survivor's pod (the job's NetworkPolicy lets only its own pods reach the store):
# the store's current generation and its plan.
READ_STORE = """
import datetime, json, os
from elastrain_trainer.inprocess.store import MembershipStore
host, _, port = os.environ["ELASTRAIN_STORE"].rpartition(":")
store = MembershipStore.connect(host, int(port), os.environ["ELASTRAIN_RUN_ID"],
                                timeout=datetime.timedelta(seconds=20))
gen = store.generation()
plan = store.read_plan(gen)
print(json.dumps({"gen": gen, "nodes": list(plan.nodes), "spares": list(plan.spares)}))
"""


def store_plan(t: TwoNodeJob, pod: str) -> dict[str, Any]:
    """The job's store as the pod's trainer reaches it (ELASTRAIN_STORE, its run's prefix)."""
    import json

    done = t.k("exec", pod, "-n", t.ns, "-c", "trainer", "--", "python3", "-c", READ_STORE,
               timeout=90)
    read: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return read


def test_3_a_partitioned_worker_is_replaced_and_stays_fenced_when_the_partition_lifts(
        two: TwoNodeJob) -> None:
    t = two
    dark, uid = worker_2_on_node_2(t)
    before = t.counters()
    survivors = t.survivors()
    # The world's plan keeps listing the pods it planned out that never came back (scenario 19's
    # kept-frozen worker, when it ran before): the new entry must be the dark worker alone.
    lost_before = max(t.logs.events("regroup"), key=lambda r: float(r["time"]))["lost"]
    # The operator goes dark with the node (item 2: the bound holds for the operator's node).
    dark_operator = t.move_operator(t.second.name)
    assert pod_processes(dark_operator["metadata"]["uid"]), "the operator's process not found"
    # Worker 2's replacement and the operator's must not be placed on the cut-off node.
    t.hold(t.second.name)
    at = time.time()
    t.second.partition()
    try:
        # The heartbeat plans it out (no socket closed: the survivors sever theirs), with no
        # operator to help: the survivors' own watch, within heartbeatTimeoutSeconds.
        fail = wait_for("the world without the dark worker", lambda: next(
            (r for r in t.logs.events("regroup") if float(r["time"]) > at
             and r["world_size"] == 2), None), timeout=60)
        assert fail["reason"] == "fail" and fail["lost"] == [*lost_before, dark], \
            (fail, lost_before)
        # The chart's tolerations (30 s on an unreachable or NotReady node, not Kubernetes'
        # 300 s) let the operator's Deployment start it on node 1; the new operator counts
        # and replaces the dark worker.
        operator = wait_for("the operator back on node 1", lambda: t.operator_ready_on(
            NODE_1, besides={dark_operator["metadata"]["uid"]}), timeout=150)
        operator_back = time.time()
        replacement = wait_for("worker 2's replacement bound to node 1",
                               lambda: t.bound(2, NODE_1), timeout=120)
        joined = wait_for("the replacement in the world, healed from a peer", lambda: next(
            (r for r in t.logs.events("regroup") if float(r["time"]) > at
             and r.get("node") == replacement and r.get("healed_from")
             and r["world_size"] == 3), None), timeout=180)
        assert t.counters() == (before[0], before[1] + 1)
        loss = t.status()["recentLosses"][-1]
        assert (loss["pod"], loss["kind"]) == (dark, "Failed"), loss
        # By the world's word or the node's (NotReady by the time the new operator runs).
        assert loss["reason"].startswith(("planned out by the in-process world",
                                          f"node {t.second.name} lost")), loss
        assert pod_processes(uid), "the dark worker's processes ended while cut off"
    finally:
        t.second.heal()
        t.release(t.second.name)
    healed = lifted_and_fenced(t, uid, dark, fail, before, survivors, steps=20)
    # The old operator, back with its node, is ended by its kubelet (its pod was evicted, at
    # the same time as the dark worker's processes end) and counted nothing twice meanwhile.
    operator_end_s = ended_after_heal(dark_operator["metadata"]["uid"],
                                      dark_operator["metadata"]["name"], ARTIFACTS / t.job,
                                      timeout=120)
    assert t.counters() == (before[0], before[1] + 1)
    after = [r for r in t.logs.events("step") if float(r["time"]) > float(joined["time"])]
    assert {r["world_size"] for r in after} == {3}, sorted({r["world_size"] for r in after})
    # The store: its generation moved on, and no plan since names the dark worker's pod.
    read = store_plan(t, next(iter(survivors)))
    assert read["gen"] >= int(joined["gen"]), read
    assert {n.rpartition(".")[0] or n for n in read["nodes"]} == \
        set(survivors) | {replacement}, read
    record_recovery("34-partition", float(joined["time"]) - at, mode=INPROCESS, pod=dark,
                    world_2_after_s=round(float(fail["time"]) - at, 1),
                    operator_back_s=round(operator_back - at, 1),
                    ended_after_heal_s=round(time.time() - healed, 1),
                    operator_ended_s=round(operator_end_s, 1))
    print(f"{dark} partitioned with the operator ({operator['metadata']['name']} back on node 1 "
          f"after {operator_back - at:.1f} s): world 2 after {float(fail['time']) - at:.1f} s, "
          f"{replacement} in the world after {float(joined['time']) - at:.1f} s")


def test_4_a_cordon_moves_a_worker_onto_a_waiting_spare_at_once_before_the_drain(
        two: TwoNodeJob) -> None:
    """Node 2 cordoned (a cordon is a notice: a drain's first step, or a person's), drained once
    the move is done: with a spare already waiting on node 1 the doomed worker is asked to leave
    at once, without waiting for its own replacement to start; the spare takes its place at that
    step boundary, the replacement (on node 1: node 2 is cordoned) becomes the new spare, and
    the drain finds none of the job's pods on node 2. Nothing is counted, no step trained below
    world 3 or twice."""
    t = two
    t.settle()
    t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=2")
    t.settle(replicas=2)
    doomed = t.put_worker_2_on_node_2()
    t.hold(t.second.name)  # the spare (worker index 3) on node 1
    try:
        t.k("patch", "trainingjob", t.job, "-n", t.ns, "--type=merge",
            "-p", '{"spec": {"spares": 1}}')
        spare = wait_for("a spare bound to node 1", lambda: t.bound(3, NODE_1), timeout=120)
        wait_for("the spare waiting", lambda: t.status().get("readySpares") == 1
                 and any(r["pod"] == spare for r in t.logs.events("spare")), timeout=240)
    finally:
        t.release(t.second.name)
    before, survivors = t.counters(), t.survivors()
    at = time.time()
    t.k("cordon", t.second.name)
    try:
        taken = wait_for("the spare healed into the doomed worker's place", lambda: next(
            (r for r in t.logs.events("regroup") if float(r["time"]) > at
             and r["pod"] == spare and r.get("healed_from")), None), timeout=120)
        assert taken["world_size"] == 3 and taken["reason"] == "leave", taken
        (left,) = [r for r in t.logs.events("left") if r["pod"] == doomed]
        replacement = wait_for("worker 2's replacement on node 1", lambda: t.bound(2, NODE_1),
                               timeout=60)
        # The doomed worker left before its own replacement was anywhere in the world.
        assert not [r for r in t.logs.events("spare") + t.logs.events("regroup")
                    if r["pod"] == replacement and float(r["time"]) < float(left["time"])]
        reasons = event_reasons(t.k, t.ns, t.job)
        assert "NodeDisruptionNotice" in reasons, reasons
        wait_for("the replacement waiting as the new spare", lambda: t.status().get(
            "readySpares") == 1 and any(r["pod"] == replacement
                                        for r in t.logs.events("spare")), timeout=240)
        # The drain once the move is done: every check of the move above came first, so a
        # later drain (it was sent 30 s after the cordon, ~15 s of it a fixed sleep) would
        # check nothing more.
        drained = time.time()
        t.k("drain", t.second.name, "--pod-selector", Training.worker_selector(t.job),
            "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=60s", timeout=120)
        assert not [p for p in t.workers() if p["spec"].get("nodeName") == t.second.name]
        mark = time.time()
        wait_for("10 steps after the move", lambda: len(
            [r for r in t.logs.events("step") if float(r["time"]) > mark]) >= 10, timeout=120)
    finally:
        t.k("uncordon", t.second.name)
    steps = [r for r in t.logs.events("step") if float(r["time"]) > at]
    assert {r["world_size"] for r in steps} == {3}, sorted({r["world_size"] for r in steps})
    assert steps_retrained(t.logs, at) == 0
    assert t.counters() == before
    # The spare was taken in in its process, like the survivors kept theirs.
    assert {n: t.survivors().get(n) for n in survivors} == survivors, \
        "a survivor's or the spare's trainer process was restarted"
    record_recovery("34-cordon-with-a-spare", float(taken["time"]) - at, mode=INPROCESS,
                    pod=doomed, spare=spare, drained_after_s=round(drained - at, 1),
                    **survivors_pause(t, at))
    print(f"{doomed} moved off cordoned {t.second.name}: spare {spare} in its place "
          f"{float(taken['time']) - at:.1f} s after the cordon; {replacement} the new spare")


def store_pod(t: TwoNodeJob) -> dict[str, Any] | None:
    """The job's store pod while it runs and is not going (None otherwise)."""
    done = t.k("get", "pod", f"{t.job}-rdzv", "-n", t.ns, "-o", "json", check=False)
    if done.returncode != 0:
        return None
    pod: dict[str, Any] = json.loads(done.stdout)
    running = pod.get("status", {}).get("phase") == "Running"
    return pod if running and not pod["metadata"].get("deletionTimestamp") else None


def test_5_the_stores_node_partitioned_stalls_no_step_and_the_store_returns_on_node_1(
        two: TwoNodeJob) -> None:
    """The node that hosts the job's store goes dark (every worker on node 1: scenario 4 leaves
    them there). The store answers nothing and closes nothing; before, the coordinator's read of
    the store at every step boundary held the world until TCP gave up on the connection, and
    the trainers' heartbeats never noticed. Now the world trains on (docs/recovery.md section 7,
    "A store that stops answering"), the operator force-deletes the store pod once node 2 is
    NotReady and creates it on node 1, and the world reclaims the new, empty store (kept: the
    coordinator restores its generation). Nothing is counted, no worker restarted, no step
    trained twice or lost. Run without a spare: a waiting spare ends when its store goes (exit
    76, replaced uncounted), and its replacement may land on node 2, where the partition makes it
    a counted loss and changes the world's kept plan (the full run at c7ee3e4 saw both)."""
    t = two
    t.k("patch", "trainingjob", t.job, "-n", t.ns, "--type=merge",
        "-p", '{"spec": {"spares": 0}}')  # scenario 4 leaves one
    wait_for("no spare", lambda: len(t.workers()) == 3 and not t.status().get("readySpares"),
             timeout=120)
    t.settle()
    if [p for p in t.workers() if p["spec"].get("nodeName") == t.second.name]:
        # Run alone (scenario 4 leaves every worker on node 1): worker 2 moved to node 1.
        t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=2")
        t.settle(replicas=2)
        t.hold(t.second.name)
        try:
            t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=3")
            wait_for("worker 2 bound to node 1", lambda: t.bound(2, NODE_1), timeout=120)
        finally:
            t.release(t.second.name)
        t.settle()
    # The store moved to node 2: its pod deleted with its node label moved there (a store lost
    # during training, reclaimed by the world: section 7).
    move_store_to(t, t.second.name)
    t.store_on(NODE_1)  # where the operator creates it once node 2 is lost
    t.settle()
    before, survivors = t.counters(), t.survivors()
    at = time.time()
    t.second.partition()
    try:
        back = wait_for("the store running on node 1", lambda: (p := store_pod(t)) is not None
                        and p["spec"].get("nodeName") == NODE_1 and p, timeout=180)
        restored = wait_for("the world in the store on node 1", lambda: next(
            (r for r in t.logs.events("store_restored") if float(r["time"]) > at), None),
            timeout=120)
        # Replaced on the trainers' word (policy.store.unheard_for), before the node controller
        # marks node 2 (its grace alone is ~40-50 s here).
        ready_then = node_ready(t, t.second.name)
        mark = time.time()
        wait_for("10 steps in the new store", lambda: len(
            [r for r in t.logs.events("step") if float(r["time"]) > mark]) >= 10, timeout=60)
    finally:
        t.second.heal()
    told = event_messages(t, "StoreLost")
    assert any("no trainer has heard the rendezvous store pod" in m for m in told), told
    # Trained on while the store was dark: no gap near the ~50 s the store was away.
    times = [at, *(float(r["time"]) for r in t.logs.events("step")
                   if at < float(r["time"]) < float(restored["time"])), float(restored["time"])]
    gap = max(b - a for a, b in itertools.pairwise(times))
    assert gap < 10, (gap, times[:5])
    unanswered = [r for r in t.logs.events("store_unanswered") if float(r["time"]) > at]
    lost = {r["pod"] for r in t.logs.events("store_lost") if float(r["time"]) > at}
    assert unanswered and lost >= set(survivors), (unanswered, lost, survivors)
    # Nothing else changed: no regroup, nothing counted, no worker restarted or step redone.
    assert not [r for r in t.logs.events("regroup") if float(r["time"]) > at]
    assert t.counters() == before
    assert {n: t.survivors().get(n) for n in survivors} == survivors, \
        "a survivor's trainer process was restarted"
    assert steps_retrained(t.logs, at) == 0
    store_back_s = float(restored["time"]) - at
    record_recovery("34-store-node-partitioned", store_back_s, mode=INPROCESS,
                    pod=back["metadata"]["name"], longest_step_gap_s=round(gap, 2),
                    steps_while_dark=len(times) - 2, node_2_ready_then=ready_then)
    print(f"store's node partitioned: {len(times) - 2} steps while it was away, longest gap "
          f"{gap:.2f} s; the world in the new store on node 1 after {store_back_s:.1f} s "
          f"(node 2 {'still Ready' if ready_then else 'NotReady'} then)")


def event_messages(t: TwoNodeJob, reason: str) -> list[str]:
    doc = t.k.json("get", "events", "-n", t.ns, "--field-selector",
                   f"involvedObject.name={t.job},reason={reason}")
    return [str(e.get("message", "")) for e in doc["items"]]


def move_store_to(t: TwoNodeJob, node: str) -> None:
    """The store's pod deleted with its node label moved to `node`; returns once the world
    reclaimed the new one there (section 7)."""
    t.store_on(node)
    moved = time.time()
    t.k("delete", "pod", f"{t.job}-rdzv", "-n", t.ns, "--wait=false")
    wait_for(f"the store running on {node}", lambda: (p := store_pod(t)) is not None
             and p["spec"].get("nodeName") == node, timeout=120)
    wait_for(f"the world in the store on {node}", lambda: [
        r for r in t.logs.events("store_restored") if float(r["time"]) > moved], timeout=120)


def test_6_a_worker_dark_with_its_store_is_planned_out_in_the_store_that_replaced_it(
        two: TwoNodeJob) -> None:
    """Worker 2 and the job's store both on node 2, then node 2 partitioned: the survivors'
    step waits on the dark worker and their heartbeat cannot judge it without a store. Before,
    nothing moved until the node controller marked node 2 (~40-50 s), then the store's
    replacement and a heartbeat timeout. Now the operator replaces the store no trainer hears
    (policy.store.unheard_for) while node 2 still reads Ready, a survivor restores the world's
    generation into it and the heartbeat plans the dark worker out there (docs/recovery.md
    section 8, "A worker and its store dark together"): world 2 in the survivors' processes,
    the dark worker replaced (one failure) and fenced once the partition lifts."""
    t = two
    dark, uid = worker_2_on_node_2(t)
    move_store_to(t, t.second.name)
    t.store_on(NODE_1)  # where the operator creates it next
    t.settle()
    before, survivors = t.counters(), t.survivors()
    lost_before = max(t.logs.events("regroup"), key=lambda r: float(r["time"]))["lost"]
    t.hold(t.second.name)  # the replacement worker on node 1
    at = time.time()
    t.second.partition()
    try:
        restored = wait_for("the world in a store on node 1", lambda: next(
            (r for r in t.logs.events("store_restored") if float(r["time"]) > at), None),
            timeout=120)
        fail = wait_for("the world without the dark worker", lambda: next(
            (r for r in t.logs.events("regroup") if float(r["time"]) > at
             and r["world_size"] == 2), None), timeout=90)
        ready_then = node_ready(t, t.second.name)
        assert fail["reason"] == "fail" and set(fail["lost"]) - set(lost_before) == {dark}, \
            (fail, lost_before)
        replacement = wait_for("worker 2's replacement bound to node 1",
                               lambda: t.bound(2, NODE_1), timeout=120)
        joined = wait_for("the replacement in the world", lambda: next(
            (r for r in t.logs.events("regroup") if float(r["time"]) > at
             and r.get("node") == replacement and r["world_size"] == 3), None), timeout=180)
        assert t.counters() == (before[0], before[1] + 1)
    finally:
        t.second.heal()
        t.release(t.second.name)
    lifted_and_fenced(t, uid, dark, fail, before, survivors, steps=10)
    told = event_messages(t, "StoreLost")
    assert any("no trainer has heard the rendezvous store pod" in m for m in told), told
    world_2_s = float(fail["time"]) - at
    record_recovery("34-worker-and-store-partitioned", world_2_s, mode=INPROCESS, pod=dark,
                    store_back_s=round(float(restored["time"]) - at, 1),
                    whole_s=round(float(joined["time"]) - at, 1), node_2_ready_then=ready_then)
    print(f"{dark} and the store partitioned: the world in a new store after "
          f"{float(restored['time']) - at:.1f} s, world 2 after {world_2_s:.1f} s (node 2 "
          f"{'still Ready' if ready_then else 'NotReady'} then), {replacement} in the world "
          f"after {float(joined['time']) - at:.1f} s")


def lifted_and_fenced(t: TwoNodeJob, uid: str, dark: str, fail: dict[str, Any],
                      before: tuple[int, int], survivors: dict[str, Incarnation], *,
                      steps: int) -> float:
    """After the partition of `dark`'s node lifted (the world planned it out in `fail`): its
    processes end (its sockets reset, it finds itself planned out; its pod was deleted, so its
    kubelet, back, stops it), `steps` more steps, and it never trained beside the world; one
    failure counted, no survivor restarted; the bucket holds no commit of its generation after
    the world moved on, none fenced, `latest` the world's newest. Returns when it lifted."""
    healed = time.time()
    ended_after_heal(uid, dark, ARTIFACTS / t.job, timeout=180)
    wait_for(f"{steps} steps after the heal", lambda: len(
        [r for r in t.logs.events("step") if float(r["time"]) > healed]) >= steps, timeout=120)
    assert not [r for r in t.logs.events("step") if r["pod"] == dark
                and float(r["time"]) > float(fail["time"])]
    assert t.counters() == (before[0], before[1] + 1)
    assert {n: t.survivors().get(n) for n in survivors} == survivors, \
        "a survivor's trainer process was restarted"
    made, latest, newest = settled_commits(t.node, t.ns, t.job)
    assert not [c for c in made if c["fenced"]], made
    assert not [c for c in made if c["gen"] < int(fail["gen"]) and c["at"] > float(fail["time"])]
    assert latest == newest["dir"], (latest, newest)
    return healed


def worker_2_on_node_2(t: TwoNodeJob) -> tuple[str, str]:
    """From the settled job: worker 2 moved to node 2 (a scale to 2, then to 3 with node 1
    held); its pod's name and uid."""
    t.settle()
    t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=2")
    t.settle(replicas=2)
    first = t.put_worker_2_on_node_2()
    # The pod in the world now (the full run at 9970d42, under load, saw the first pod bound
    # to node 2 replaced by another, there too, before it started; not explained).
    pod = t.bound(2, t.second.name)
    assert pod is not None, f"worker 2 ({first} at first) is not on {t.second.name}"
    if pod != first:
        print(f"worker 2's pod {first} was replaced by {pod} before it trained")
    return pod, str(t.k.json("get", "pod", pod, "-n", t.ns)["metadata"]["uid"])
