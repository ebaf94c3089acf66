"""Scenario 24 (issue 35 items 1 and 2): the e2e job with `nprocPerNode: 2` and `strategy: hsdp`
in InProcess mode on a real kubelet: 3 pods x 2 ranks, world 6, min 2 pods (global batch 24:
whole micro-batches at 6 ranks and at 4); each pod holds a whole replica of the model, sharded
over its two ranks.

A worker pod is evicted: both its ranks leave at one step boundary, the four ranks of the other
two pods keep their processes and train on at world 4 (one replica fewer: nothing handed over,
nothing loaded), and the eviction is one preemption. The operator's replacement joins whole,
its ranks healed from the same positions of a live pod (world 6 again). Then a pod's trainer
container is SIGKILLed (both ranks, no notice): the survivors regroup at world 4, again without
a checkpoint load, the loss is one failure (not one per rank), and the replacement brings the
world back to 6. (DDP with two ranks per pod is covered by the trainer's integration tests.)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from tests.e2e.conftest import NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    Incarnation,
    LogCollector,
    Training,
    container_pid,
    event_reasons,
    make_job,
    record_recovery,
    steps_retrained,
    wait_for,
)

JOB = "hsdp-inprocess"
PODS, RANKS = 3, 2
# The bound on a regroup without notice: a killed container closes its sockets (docs/recovery.md
# section 8); slack for a loaded two-core machine.
NO_NOTICE_BOUND_S = 15.0


def kept(before: dict[str, Incarnation], after: dict[str, Incarnation], lost: str) -> None:
    survivors = {n: inc for n, inc in before.items() if n != lost}
    assert all(len(inc.workers) == RANKS for inc in survivors.values()), survivors
    assert {n: after.get(n) for n in survivors} == survivors, \
        "a survivor's rank process was restarted"


def at_world(t: Training, world: int, since: float, what: str) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(what, lambda: next(
        (r for r in t.logs.events("step") if float(r["time"]) > since
         and r.get("world_size") == world), None), timeout=300)
    return found


def test_24_pods_of_two_ranks_leave_fail_and_rejoin_as_units_in_process(
        operator: NodeCluster, job_namespace: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    job = make_job(JOB, ns, image=node.images["trainer"], steps=100_000,
                   s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket,
                   nprocPerNode=RANKS, strategy="hsdp", recovery={"mode": INPROCESS})
    job["spec"]["trainer"]["globalBatchSize"] = 24
    k.apply(job)
    with LogCollector(k, ns, Training.worker_selector(JOB), ARTIFACTS / JOB) as logs:
        t = Training(k, ns, JOB, logs, INPROCESS)
        wait_for("3 ready workers", lambda: t.at_full_size(PODS), timeout=240)
        at_world(t, PODS * RANKS, time.time(), "a training step at world 6")

        # An eviction (notice): both ranks of the pod leave together.
        before, processes = t.counters(), t.processes()
        pod = t.worker(1)
        at = t.evict(pod)
        first = t.recovered_after(at)
        assert first["world_size"] == (PODS - 1) * RANKS, first
        recovery_s = float(first["time"]) - at
        kept(processes, t.processes(), pod)
        assert not [r for r in logs.events("resumed") if float(r["time"]) > at]
        left = [r for r in logs.events("left") if float(r["time"]) > at]
        assert len({r["step"] for r in left}) == 1 and len(left) == RANKS, left
        t.counted_once_in_process(before, pod, at)
        # After the world-4 step: a step at world 6 may end between the eviction's call and
        # the pod's SIGTERM (the full run at c7ee3e4 took step 6 for "whole again").
        whole = at_world(t, PODS * RANKS, float(first["time"]),
                         "world 6 again after the replacement joined")
        healed = {r["node"]: r["healed_from"] for r in logs.events("regroup")
                  if float(r["time"]) > at and r.get("healed_from")}
        assert sorted(n.rpartition("/")[2] for n in healed) == ["0", "1"], healed
        assert all(n.rpartition("/")[2] == s.rpartition("/")[2] for n, s in healed.items())
        record_recovery("24-ranks-evict-worker-1", recovery_s, mode=INPROCESS, pod=pod,
                        world_size=first["world_size"],
                        full_world_s=round(float(whole["time"]) - at, 2))
        print(f"nprocPerNode 2, evicted {pod}: world 4 after {recovery_s:.2f} s, world 6 again "
              f"{float(whole['time']) - at:.2f} s after the eviction")

        # A SIGKILL (no notice): the container and both its ranks die at once.
        before, processes = t.counters(), t.processes()
        pod = t.worker(2)
        killed = time.time()
        os.kill(container_pid(k, ns, pod), signal.SIGKILL)
        first = t.recovered_after(killed)
        assert first["world_size"] == (PODS - 1) * RANKS, first
        recovery_s = float(first["time"]) - killed
        assert recovery_s < NO_NOTICE_BOUND_S, recovery_s
        kept(processes, t.processes(), pod)
        # HSDP: the lost pod was one replica; FSDP2 would have restarted from the checkpoint.
        assert not [r for r in logs.events("resumed") if float(r["time"]) > killed]
        assert not [r for r in logs.events("shards_lost") if float(r["time"]) > killed]
        wait_for("the failure counted", lambda: t.counters()[1] == before[1] + 1)
        time.sleep(5)  # a second count would come with the next reconcile
        assert t.counters() == (before[0], before[1] + 1)
        assert steps_retrained(logs, killed) <= 1
        assert "WorkerFailed" in event_reasons(k, ns, JOB)
        whole = at_world(t, PODS * RANKS, float(first["time"]),
                         "world 6 again after the SIGKILL")
        record_recovery("24-ranks-sigkill-worker-2", recovery_s, mode=INPROCESS, pod=pod,
                        world_size=first["world_size"],
                        full_world_s=round(float(whole["time"]) - killed, 2))
        print(f"nprocPerNode 2, SIGKILLed {pod}: world 4 after {recovery_s:.2f} s, world 6 "
              f"again {float(whole['time']) - killed:.2f} s after the kill")
    k("delete", "trainingjob", JOB, "-n", ns, "--wait=true", "--timeout=120s", check=False)
