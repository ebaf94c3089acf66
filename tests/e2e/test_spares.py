"""Scenario 16 (docs/recovery.md section 12): warm spares on a real kubelet.

An InProcess job with `spec.spares: 1` (3 workers, min 2, max 4) runs 4 worker
pods: 3 train, 1 waits with torch imported and its model built, answering the operator's poll
with `"role": "spare"` (status.readySpares 1, WORKERS 3/3). A member pod is evicted: at the next
step boundary the spare takes its place, healed from a live peer, so the world never drops
below 3; the survivors and the spare keep their processes; the loss is one preemption, 0 steps
are lost; the operator's replacement pod becomes the new spare. Then `kubectl scale` to 4: the
operator tells the trainers on its control channel (docs/recovery.md section 9), and the
waiting spare is taken in, in its process. The join time (eviction ->
first step at world 3 again) is recorded beside scenario 1's, where the world is whole again
only once the replacement pod has started, imported torch and joined.
"""

from __future__ import annotations

import time
from typing import Any

from tests.e2e.conftest import NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    LogCollector,
    Training,
    make_job,
    record_recovery,
    wait_for,
)

JOB = "spares"


def waiting_spares(logs: LogCollector) -> set[str]:
    """Pods whose latest `spare` record (named beyond the world) has no `regroup` of theirs
    after it (a spare taken in is healed, and says so)."""
    state: dict[str, bool] = {}
    for r in sorted(logs.events("spare") + logs.events("regroup"), key=lambda r: r["time"]):
        state[r["pod"]] = r["event"] == "spare"
    return {pod for pod, spare in state.items() if spare}


def full_with_a_spare(t: Training) -> bool:
    s = t.status()
    return bool(s.get("phase") == "Running" and s.get("readyReplicas") == 3
                and s.get("readySpares") == 1 and len(waiting_spares(t.logs)) == 1)


def test_16_a_spare_takes_an_evicted_workers_place_and_the_replacement_waits(
        operator: NodeCluster, job_namespace: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    job = make_job(JOB, ns, image=node.images["trainer"], steps=100_000,
                   s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket,
                   recovery={"mode": INPROCESS}, spares=1, maxReplicas=4)
    # A world of 4 must split the global batch too (12 does not in micro-batches of 2: the
    # trainers would keep 3, as docs/recovery.md section 3 says).
    job["spec"]["trainer"]["globalBatchSize"] = 24
    k.apply(job)
    with LogCollector(k, ns, Training.worker_selector(JOB), ARTIFACTS / JOB) as logs:
        t = Training(k, ns, JOB, logs, INPROCESS)
        wait_for("3 members and a ready spare", lambda: full_with_a_spare(t), timeout=300)
        t.settle()
        assert len(t.workers()) == 4
        row = k("get", "tj", JOB, "-n", ns).stdout.splitlines()
        print("\n".join(row))
        (spare,) = waiting_spares(logs)
        member = next(p["metadata"]["name"] for p in t.workers()
                      if p["metadata"]["name"] != spare)
        before, processes = t.counters(), t.processes()
        at = t.evict(member)
        joined: dict[str, Any] = wait_for("the spare healed into the world", lambda: next(
            (r for r in logs.events("regroup") if float(r["time"]) > at and r["pod"] == spare
             and r.get("healed_from")), None), timeout=120)
        assert joined["world_size"] == 3 and joined["reason"] == "leave", joined
        first = wait_for("a step at world 3 after the spare joined", lambda: next(
            (r for r in logs.events("step") if float(r["time"]) > float(joined["time"])
             and r.get("world_size") == 3), None), timeout=120)
        join_s = float(first["time"]) - at
        record_recovery("16-evict-with-a-spare", join_s, mode=INPROCESS, pod=member,
                        full_world_s=round(join_s, 2), healed_from=joined["healed_from"])
        # The world never dropped below 3: no step after the eviction trained at world 2.
        assert not [r for r in logs.events("step")
                    if float(r["time"]) > at and r.get("world_size") != 3]
        after = t.processes()
        kept = {n: inc for n, inc in processes.items() if n != member}
        assert {n: after.get(n) for n in kept} == kept, "a survivor's process was restarted"
        # The replacement pod is the new spare; the loss is one preemption, nothing lost.
        wait_for("the replacement waiting as the new spare",
                 lambda: full_with_a_spare(t) and waiting_spares(logs) - {spare, member},
                 timeout=300)
        recovery = t.counted_once_in_process(before, member, at)
        print(f"evicted {member}: spare {spare} healed from {joined['healed_from']}, world 3 "
              f"again {join_s:.2f} s after the eviction; lastRecovery {recovery}")
        # `kubectl scale` reaches the trainers only on the operator's control channel (POST
        # /control with the job's token from its Secret; a GET changes nothing): the waiting
        # spare is taken in, in its process, at a world of 4.
        (new_spare,) = waiting_spares(logs)
        scaled = time.time()
        k("scale", "trainingjob", JOB, "-n", ns, "--replicas=4")
        grown = wait_for("the spare taken in at world 4", lambda: next(
            (r for r in logs.events("regroup") if float(r["time"]) > scaled
             and r["pod"] == new_spare and r.get("world_size") == 4), None), timeout=120)
        print(f"scaled to 4: {new_spare} taken in ({grown['reason']}) "
              f"{float(grown['time']) - scaled:.2f} s after kubectl scale")
    k("delete", "trainingjob", JOB, "-n", ns, "--wait=true", "--timeout=120s", check=False)
