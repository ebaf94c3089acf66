"""Scenario 18 (docs/recovery.md section 12): an FSDP2 job in InProcess mode on a real kubelet.

The e2e job's shape (3 workers, min 2, gloo) with `strategy: fsdp`: every worker holds a third
of the model and of AdamW's state. A worker is evicted: before it exits, on the old group, it
hands its rows to the two survivors (inprocess/fsdp.py), which rebuild the model at world 2 and
train on in their processes; nothing is loaded from the checkpoint and no step is lost. The
operator's replacement joins and receives its chunk from the survivors (world 3 again). The loss
is one preemption, recorded as an in-process recovery.
"""

from __future__ import annotations

from tests.e2e.conftest import NodeCluster
from tests.e2e.support import (
    ARTIFACTS,
    INPROCESS,
    Incarnation,
    LogCollector,
    Training,
    make_job,
    record_recovery,
    wait_for,
)

JOB = "fsdp-inprocess"


def kept(before: dict[str, Incarnation], after: dict[str, Incarnation], lost: str) -> None:
    survivors = {n: inc for n, inc in before.items() if n != lost}
    assert all(inc.workers for inc in survivors.values()), survivors
    assert {n: after.get(n) for n in survivors} == survivors, \
        "a survivor's trainer process was restarted"


def test_18_an_evicted_fsdp_worker_hands_its_shards_over_in_process(
        operator: NodeCluster, job_namespace: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    k.apply(make_job(JOB, ns, image=node.images["trainer"], steps=100_000,
                     s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket,
                     strategy="fsdp", recovery={"mode": INPROCESS}))
    with LogCollector(k, ns, Training.worker_selector(JOB), ARTIFACTS / JOB) as logs:
        t = Training(k, ns, JOB, logs, INPROCESS)
        t.settle()
        before, processes = t.counters(), t.processes()
        pod = t.worker(1)
        at = t.evict(pod)
        first = t.recovered_after(at)
        assert first["world_size"] == 2, first
        recovery_s = float(first["time"]) - at
        leave = [r for r in logs.events("regroup")
                 if float(r["time"]) > at and r["reason"] == "leave" and r["world_size"] == 2]
        assert leave, "no in-process regroup to world 2"
        kept(processes, t.processes(), pod)
        # No survivor loaded a checkpoint: the leaver's rows came from the leaver.
        assert not [r for r in logs.events("resumed") if float(r["time"]) > at]
        joined = wait_for("the replacement healed into world 3", lambda: next(
            (r for r in logs.events("regroup") if float(r["time"]) > at
             and r.get("healed_from") and r["world_size"] == 3), None), timeout=300)
        whole = wait_for("a step at world 3 after the join", lambda: next(
            (r for r in logs.events("step") if float(r["time"]) > float(joined["time"])
             and r.get("world_size") == 3), None), timeout=120)
        record_recovery("18-fsdp-evict-worker-1", recovery_s, mode=INPROCESS, pod=pod,
                        world_size=2, handover_s=leave[0].get("heal_s"),
                        full_world_s=round(float(whole["time"]) - at, 2),
                        join_heal_s=joined.get("heal_s"))
        kept(processes, t.processes(), pod)
        t.counted_once_in_process(before, pod, at)
        print(f"FSDP2 evicted {pod}: world 2 after {recovery_s:.2f} s (handover + rebuild "
              f"{leave[0].get('heal_s')} s), the replacement healed in ({joined.get('heal_s')} "
              f"s), world 3 again {float(whole['time']) - at:.2f} s after the eviction")
    k("delete", "trainingjob", JOB, "-n", ns, "--wait=true", "--timeout=120s", check=False)
