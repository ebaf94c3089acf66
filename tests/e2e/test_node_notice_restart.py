"""Issue 34 in Restart mode on two real nodes (tests/e2e/two_nodes.py); worker 2 on node 2.

1. Item 5, "a save, then the move": node 2 is tainted `karpenter.sh/disrupted:NoSchedule`. The
   operator creates worker 2's replacement first; once the scheduler has bound it to node 1,
   the operator deletes the doomed pod, whose SIGTERM makes every worker save the step and
   restart from it (torchrun's rendezvous), the replacement among them. All of it before any
   drain: the drain that Karpenter sends afterwards finds none of the job's pods on the node.
   Nothing is counted and no step is lost; the notice condition ends once the move is done.
   (The InProcess move, with a drain quicker than the move, is test_node_loss.py's scenario 2.)
19r. Item 4, a worker kept frozen (every process of its trainer container stopped: no socket
   closed, as a hung host): the survivors' dark-peer watch restarts the group without it
   (torchrun's rendezvous leaves it out once its keep-alive lapses), and, its node being Ready
   and its pod Running, only the re-formed group's word (the pod it marked dark, `plannedOut`)
   makes the operator count it and replace it (before, it ran on uncounted and the job stayed at
   world 2). The InProcess freeze is test_node_loss.py's scenario 19; this one runs on this
   module's job, already up, where a job of its own cost ~80 s. After scenario 1 the frozen
   worker is worker 2 (moved to node 1), and its replacement is placed on node 2, where
   scenario 2 wants it.
2. Items 2-4: node 2 partitioned (every packet to and from it dropped: no socket closes). The
   survivors' dark-peer watch (session/dark_peers.py) ends their group by the heartbeat, not
   gloo's 5-minute collective timeout, and torchrun's rendezvous re-forms it at world 2 once the
   dark agent's keep-alive lapses. Node 2 goes NotReady; the operator counts the worker once as
   a failure, force-deletes it and creates its replacement on node 1, and the group is whole
   again. When the partition lifts, the dark worker's processes end without a step or a commit
   beside the world: every commit since the partition is of a newer group (generations rise in
   commit order), none fenced, `latest` the newest.
3. Item 4 in Restart mode: node 2's kubelet and containerd stopped. Its worker's processes run
   on (no kubelet to stop them). Once node 2 is NotReady the operator counts the worker once
   as a failure, force-deletes its pod and creates the replacement on node 1 at once, long
   before the 300 s Kubernetes gives by default, and the group re-forms with it at world 3.
   When the runtime comes back, node 2's kubelet ends the orphan (its pod is gone); the group
   trains on whole, nothing more is counted, `latest` is the newest commit. (In the first run
   here, whose orphan log was kept, the orphan's own connections to the job's store failed
   right after the stop, "Network is unreachable", so it held no place the replacement had to
   wait for.)
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import NamespacePool, NodeCluster
from tests.e2e.support import (
    RESTART,
    Training,
    container_pid,
    event_reasons,
    first_step_after_change,
    group_starts,
    process_tree,
    record_recovery,
    signal_all,
    steps_lost_at,
    wait_for,
)
from tests.e2e.two_nodes import (
    KARPENTER,
    NODE_1,
    TwoNodeJob,
    job_on_two_nodes,
    node_ready,
    pod_processes,
    settled_commits,
)

JOB = "notice-restart"


@pytest.fixture(scope="module")
def two(operator: NodeCluster, namespace_pool: NamespacePool) -> Iterator[TwoNodeJob]:
    with job_on_two_nodes(operator, namespace_pool, JOB, RESTART) as t:
        yield t


def notice_messages(t: TwoNodeJob) -> list[str]:
    doc = t.k.json("get", "events", "-n", t.ns, "--field-selector",
                   f"involvedObject.name={t.job},reason=NodeDisruptionNotice")
    return [str(e["message"]) for e in doc["items"]]


def notice(t: TwoNodeJob) -> dict[str, Any]:
    return next((c for c in t.status().get("conditions", [])
                 if c["type"] == "NodeDisruptionNotice"), {})


def test_1_a_noticed_worker_moves_with_a_save_before_any_drain_and_nothing_is_counted(
        two: TwoNodeJob) -> None:
    t = two
    t.settle()
    doomed = t.bound(2, t.second.name)
    assert doomed is not None
    before = t.counters()
    at = time.time()
    t.k("taint", "node", t.second.name, f"{KARPENTER}=:NoSchedule", "--overwrite")
    try:
        # Told by its event: the condition is True only while the move runs, which can be
        # shorter than a poll here (a full e2e run missed it: bound and deleted within 1 s).
        said = wait_for("the move started", lambda: [
            m for m in notice_messages(t) if f"node {t.second.name}: taint {KARPENTER}" in m],
            timeout=60)
        assert "worker 2" in said[0] and doomed in said[0], said
        replacement = wait_for("worker 2's replacement bound to node 1",
                               lambda: t.bound(2, NODE_1), timeout=120)
        # Deleted by the operator, not by a drain (none has been sent).
        wait_for("the doomed pod gone", lambda: t.k(
            "get", "pod", doomed, "-n", t.ns, check=False).returncode != 0, timeout=180)
        moved = time.time()
        first = t.resumed_after(at)
        # Its SIGTERM saved the step every worker resumed from.
        assert steps_lost_at(t.logs, at) == 0
        # Rank 0 tells the resume; the world it resumed at is whole, so the replacement is in it
        # (and it saves its shard beside the others).
        (resumed, *_) = [r for r in t.logs.events("resumed") if float(r["time"]) > at]
        assert resumed["world_size"] == 3, resumed
        wait_for("the replacement's first save", lambda: [
            r for r in t.logs.events("checkpoint_saved") if r["pod"] == replacement
            and float(r["time"]) > float(resumed["time"])], timeout=120)
        # Karpenter's drain, afterwards: nothing of the job's is left on node 2.
        t.k("drain", t.second.name, "--pod-selector", Training.worker_selector(t.job),
            "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=60s", timeout=120)
        t.settle()
        wait_for("the notice condition ended", lambda: notice(t).get("status") == "False",
                 timeout=60)
        assert t.bound(2, NODE_1) == replacement
        assert not [p for p in t.workers() if p["spec"].get("nodeName") == t.second.name]
        # Not counted: the operator moved it with a save, at a step boundary of its choosing.
        time.sleep(5)
        assert t.counters() == before
        assert "NodeDisruptionNotice" in event_reasons(t.k, t.ns, t.job)
        assert not {"WorkerPreempted", "WorkerFailed"} & set(event_reasons(t.k, t.ns, t.job))
        record_recovery("34-notice-restart", float(first["time"]) - at, mode=RESTART,
                        pod=doomed, moved_s=round(moved - at, 1))
        print(f"{doomed} moved off {t.second.name} by {replacement}: deleted "
              f"{moved - at:.1f} s after the taint, training at step {first['step']} "
              f"{float(first['time']) - at:.1f} s after it")
    finally:
        t.k("taint", "node", t.second.name, f"{KARPENTER}:NoSchedule-", check=False)
        t.k("uncordon", t.second.name, check=False)


def test_19r_a_worker_kept_frozen_is_left_out_counted_and_replaced(two: TwoNodeJob) -> None:
    t = two
    t.settle()
    # Frozen on node 1, whose containerd names its processes. After scenario 1 that is worker 2
    # (moved there), and with node 1 held its replacement goes to node 2, where scenario 2 wants
    # it (that saves scenario 2 a scale down and up). Run alone: worker 1, replaced on node 1.
    index = 2 if t.node_of(t.worker(2)) == NODE_1 else 1
    home, held = (t.second.name, NODE_1) if index == 2 else (NODE_1, t.second.name)
    wait_for("a commit before the freeze", lambda: t.logs.events("checkpoint_saved"),
             timeout=120)
    dark = t.worker(index)
    assert t.node_of(dark) == NODE_1
    before = t.counters()
    frozen = process_tree(container_pid(t.k, t.ns, dark))
    t.hold(held)
    at = time.time()
    signal_all(frozen, signal.SIGSTOP)
    try:
        first = wait_for("the group re-formed at world 2",
                         lambda: first_step_after_change(t.logs, at), timeout=120)
        assert first["world_size"] == 2, first
        told = wait_for("the re-formed group naming the frozen pod", lambda: [
            r for r in t.logs.events("planned_out") if float(r["time"]) > at], timeout=60)
        assert told[0]["pods"] == [dark], told
        replacement = wait_for(f"worker {index}'s replacement pod", lambda: next(
            (p["metadata"]["name"] for p in t.pods_of(index) if p["metadata"]["name"] != dark),
            None), timeout=120)
        replaced_s = time.time() - at
        wait_for(f"the replacement bound to {home}", lambda: t.node_of(replacement) == home,
                 timeout=60)
    finally:
        signal_all(frozen, signal.SIGCONT)  # being deleted: let its kubelet end it
        t.release(held)
    whole = wait_for("a step at world 3 with the replacement", lambda: next(
        (r for r in t.logs.events("step") if float(r["time"]) > at + replaced_s
         and r.get("world_size") == 3), None), timeout=240)
    wait_for("the loss counted", lambda: t.counters() != before, timeout=60)
    assert t.counters() == (before[0], before[1] + 1), (before, t.counters())
    loss = t.status()["recentLosses"][-1]
    assert (loss["pod"], loss["kind"]) == (dark, "Failed"), loss
    assert loss["reason"].startswith("left out of the re-formed worker group"), loss
    record_recovery("19r-frozen-worker-restart", float(first["time"]) - at, mode=RESTART,
                    pod=dark, replaced_after_s=round(replaced_s, 1),
                    whole_s=round(float(whole["time"]) - at, 1))
    print(f"{dark} frozen (Restart): world 2 after {float(first['time']) - at:.1f} s, "
          f"replaced by {replacement} on {home} after {replaced_s:.1f} s, world 3 again "
          f"{float(whole['time']) - at:.1f} s after the freeze")


def test_2_a_partitioned_worker_restarts_the_group_by_the_heartbeat_and_stays_fenced(
        two: TwoNodeJob) -> None:
    t = two
    t.settle()
    if t.node_of(t.worker(2)) != t.second.name:  # scenario 1 moved it to node 1
        t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=2")
        t.settle(replicas=2)
        t.put_worker_2_on_node_2()
    dark = t.worker(2)
    assert t.node_of(dark) == t.second.name
    uid = t.k.json("get", "pod", dark, "-n", t.ns)["metadata"]["uid"]
    before = t.counters()
    # Commits before the partition to compare with (run alone, this job has made none yet).
    wait_for("a commit before the partition",
             lambda: t.logs.events("checkpoint_saved"), timeout=120)
    made_before, _ = settled_commits(t.node, t.ns, t.job)[:2]
    gen_before = max((c["gen"] for c in made_before if not c["fenced"]), default=0)
    t.hold(t.second.name)  # its replacement goes to node 1
    at = time.time()
    t.second.partition()
    try:
        # A survivor's watch, then the group re-formed without the dark node: far below gloo's
        # collective timeout (300 s), which is all that ended the wait before.
        first = t.resumed_after(at, timeout=120)
        assert first["world_size"] == 2, first
        seen = [r for r in t.logs.events("dark_peer") if float(r["time"]) > at]
        assert seen and all(r["pod"] != dark for r in seen), seen
        replacement = wait_for("worker 2's replacement bound to node 1",
                               lambda: t.bound(2, NODE_1), timeout=180)
        whole = wait_for("the group whole again", lambda: next(
            (r for r in group_starts(t.logs, float(first["time"]))
             if r.get("world_size") == 3), None), timeout=240)
        wait_for("the loss counted", lambda: t.counters() != before, timeout=60)
        assert t.counters() == (before[0], before[1] + 1), (before, t.counters())
        loss = t.status()["recentLosses"][-1]
        assert (loss["pod"], loss["kind"]) == (dark, "Failed"), loss
    finally:
        t.second.heal()
        t.release(t.second.name)
    healed = time.time()
    wait_for("the dark worker's processes ended", lambda: not pod_processes(uid), timeout=180)
    wait_for("a commit after the heal", lambda: [
        r for r in t.logs.events("checkpoint_saved") if float(r["time"]) > healed], timeout=120)
    assert not [r for r in t.logs.events("step") if r["pod"] == dark
                and float(r["time"]) > float(first["time"])]
    # The bucket: whatever the dark worker held, every commit since the partition is of a
    # newer group than any before it, none fenced, and `latest` is the newest.
    made, latest, newest = settled_commits(t.node, t.ns, t.job)
    assert not [c for c in made if c["fenced"]], made
    since = sorted((c for c in made if not c["fenced"] and c["at"] > at), key=lambda c: c["at"])
    assert since and all(c["gen"] > gen_before for c in since), (gen_before, since)
    assert [c["gen"] for c in since] == sorted(c["gen"] for c in since), since
    assert latest == newest["dir"], (latest, newest)
    assert t.bound(2, NODE_1) == replacement
    record_recovery("34-partition-restart", float(first["time"]) - at, mode=RESTART, pod=dark,
                    whole_s=round(float(whole["time"]) - at, 1))
    print(f"{dark} partitioned: training at world 2 {float(first['time']) - at:.1f} s after, "
          f"whole again ({replacement}) {float(whole['time']) - at:.1f} s after")


def test_3_a_node_whose_runtime_stopped_is_counted_once_and_replaced_on_node_1(
        two: TwoNodeJob) -> None:
    t = two
    t.settle()
    if t.node_of(t.worker(2)) != t.second.name:  # scenarios 1 and 2 moved it to node 1
        t.k("scale", "trainingjob", t.job, "-n", t.ns, "--replicas=2")
        t.settle(replicas=2)
        t.put_worker_2_on_node_2()
    orphan = t.worker(2)
    uid = t.k.json("get", "pod", orphan, "-n", t.ns)["metadata"]["uid"]
    assert t.node_of(orphan) == t.second.name and pod_processes(uid)
    before = t.counters()
    at = time.time()
    t.second.stop_runtime()
    try:
        assert pod_processes(uid), "the orphan's processes stopped with its runtime"
        replacement = wait_for("worker 2's replacement bound to node 1",
                               lambda: t.bound(2, NODE_1), timeout=240)
        replaced_s = time.time() - at
        wait_for("the loss counted", lambda: t.counters() != before, timeout=60)
        assert t.counters() == (before[0], before[1] + 1), (before, t.counters())
        loss = t.status()["recentLosses"][-1]
        assert (loss["pod"], loss["kind"]) == (orphan, "Failed"), loss
        assert loss["reason"].startswith(f"node {t.second.name} lost"), loss
        # Force-deleted while node 2 is NotReady: not left to the taint manager's eviction.
        assert t.k("get", "pod", orphan, "-n", t.ns, check=False).returncode != 0
        assert not node_ready(t, t.second.name)
        mark = time.time()
        wait_for("training on while the runtime is away", lambda: [
            r for r in t.logs.events("step") if float(r["time"]) > mark], timeout=120)
    finally:
        t.second.start_runtime()
    back = time.time()
    wait_for("the orphan's processes ended by its kubelet", lambda: not pod_processes(uid),
             timeout=180)
    # A worker process starts only once its rendezvous completed: the replacement's first
    # record is its place in a group, and the group start next to it says at what size.
    # (Step records are rank 0's alone, so they name no other pod.)
    joined = wait_for("the replacement's trainer started in a group", lambda: next(
        (r for r in t.logs.events("checkpoint_location_ok") if r["pod"] == replacement), None),
        timeout=300)
    whole = wait_for("the group whole with the replacement", lambda: next(
        (r for r in group_starts(t.logs, float(joined["time"]) - 5)
         if r.get("world_size") == 3), None), timeout=120)
    wait_for("steps at world 3 after the runtime came back", lambda: [
        r for r in t.logs.events("step") if float(r["time"]) > back
        and r.get("world_size") == 3], timeout=120)
    assert t.counters() == (before[0], before[1] + 1), (before, t.counters())
    wait_for("a commit after the group is whole", lambda: [
        r for r in t.logs.events("checkpoint_saved") if float(r["time"]) > float(whole["time"])],
        timeout=120)
    made, latest, newest = settled_commits(t.node, t.ns, t.job)
    assert not [c for c in made if c["fenced"] and c["at"] > at], made
    assert latest == newest["dir"], (latest, newest)
    record_recovery("34-runtime-stopped-restart", replaced_s, mode=RESTART, pod=orphan,
                    whole_s=round(float(whole["time"]) - at, 1))
    print(f"{orphan}: runtime stopped (Restart); replaced by {replacement} on node 1 after "
          f"{replaced_s:.1f} s, world 3 with it {float(whole['time']) - at:.1f} s after the stop")
