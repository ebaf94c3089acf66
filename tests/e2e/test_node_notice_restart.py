"""Issue 34 item 5 in Restart mode on two real nodes (tests/e2e/two_nodes.py): "a save, then the
move". Node 2, where worker 2 runs, is tainted `karpenter.sh/disrupted:NoSchedule`. The operator
creates worker 2's replacement first; once the scheduler has bound it to node 1, the operator
deletes the doomed pod, whose SIGTERM makes every worker save the step and restart from it
(torchrun's rendezvous), the replacement among them. All of it before any drain: the drain
that Karpenter sends afterwards finds none of the job's pods on the node. Nothing is counted and
no step is lost; the notice condition ends once the move is done.

(The InProcess move, with a drain quicker than the move, is test_node_loss.py's scenario 2.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import NamespacePool, NodeCluster
from tests.e2e.support import (
    RESTART,
    Training,
    event_reasons,
    record_recovery,
    steps_lost_at,
    wait_for,
)
from tests.e2e.two_nodes import KARPENTER, NODE_1, TwoNodeJob, job_on_two_nodes

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


def test_a_noticed_worker_moves_with_a_save_before_any_drain_and_nothing_is_counted(
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
