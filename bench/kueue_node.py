"""Kueue preemption on the real node (issue 36 item 5): how long Kueue waits for a preempted
TrainingJob's quota, and what the job loses, beside what a plain suspend would lose.

    sudo .venv/bin/python bench/kueue_node.py [--events 3] [--interval-steps 40] [--out ...]
    make bench-kueue-node            # root; ~15 min here with the images and Kueue cached

The node, the operator (its chart) and Kueue v0.17.0 run as in e2e scenario 22
(tests/e2e/kueue_job.py). One InProcess job (the e2e job: 3 workers, min 2, the tiny GPT paced
at 0.25 s a step, a periodic commit every --interval-steps) in a ClusterQueue that fits it or a
Workload of a higher priority, not both. Per event: the job trains at full size past a periodic
commit by a different number of steps each time; the preemptor is created, and then

- freed_s: preemptor created -> Kueue admitted it. Kueue admits it only once the operator
  released the job's quota, which it does once no pod of the job is left: the trainers' save
  at the step boundary, their exit and the pods' deletion are inside it;
- steps_lost: the last step trained before the pods stopped - the step the job resumed from
  when it was admitted again (goal 0);
- plain_suspend_loses: the same last step - the newest periodic commit when the preemptor was
  created: where a job that does not save on its SIGTERM (a suspend that only deletes the pods)
  resumes from. Computed from the same run's records, at the same checkpoint interval;
- back_s: preemptor deleted -> the job's first training step after its resume (Kueue's
  re-admission, the pods' start, torch's import and the checkpoint load).

Then shrink to yield (item 4), once: a second InProcess job (3 workers, min 2) in a
ClusterQueue with Kueue's default policy (no preemption within it) and 50m of CPU left; a Workload
of a higher priority asks for 100m, so without the yield it would wait for as long as the job
runs. The job lets one worker go at a step boundary and reports it in reclaimablePods:

- yield_admitted_s: the Workload created -> Kueue admitted it (the operator's decision, the
  worker's leave at the step boundary, its pod's end, the status patch, Kueue's next cycle);
- yield_pause_s: the survivors' regroup and heal for that leave (their own timing);
- yield_stopped: whether the job's group started again (a resume) at any point: goal false.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from tests.e2e.conftest import (  # noqa: E402
    create_job_namespace,
    install_operator,
    prepare_node,
    running_node,
)
from tests.e2e.kueue_job import QueuedJob, Queues, kueue_running, queued_job  # noqa: E402
from tests.e2e.support import (  # noqa: E402
    INPROCESS,
    LogCollector,
    Training,
    group_starts,
    steps_retrained,
    wait_for,
)

JOB = "kueue-bench"
Record = dict[str, Any]


def measure(t: QueuedJob, queues: Queues, events: int, interval: int) -> list[Record]:
    rows = []
    for i in range(events):
        t.settle()
        # Past a periodic commit by a different share of the interval each time.
        commit = wait_for("a periodic commit at full size", lambda: next(
            (int(r["step"]) for r in reversed(t.logs.events("checkpoint_saved"))
             if int(r["step"]) % interval == 0 and int(r["step"]) > t.logs.max_step() - interval),
            None), timeout=300)
        t.logs.wait_for_step(commit + 1 + (i * interval) // max(events, 1) % (interval - 1))
        p = t.preempt(queues)
        deleted, resumed = t.readmit()
        step = t.first_step_since(float(resumed["time"]))
        row = {"event": i, "freed_s": round(p.freed_s, 2), "reached": p.reached,
               "saved": p.saved, "periodic": p.periodic,
               "steps_lost": p.reached - int(resumed["step"]),
               "plain_suspend_loses": p.reached - p.periodic,
               "back_s": round(float(step["time"]) - deleted, 2),
               "resumed_world": resumed.get("world_size")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def measure_yield(node: Any, logs_dir: Path) -> Record:
    ns = f"bench-kueue-{uuid.uuid4().hex[:4]}"
    create_job_namespace(node, ns)
    queues = Queues(ns, cpu="400m", preempts=False)  # the job's 350m fit, 50m left
    queues.create(node)
    job = f"{JOB}-yield"
    node.kubectl.apply(queued_job(node, queues, job, steps=1_000_000,
                                  recovery={"mode": INPROCESS}))
    with LogCollector(node.kubectl, ns, Training.worker_selector(job), logs_dir) as logs:
        t = QueuedJob(node.kubectl, ns, job, logs, INPROCESS)
        t.settle()
        at, admitted_s = t.urgent(queues, "100m")
        step = wait_for("a step at world 2", lambda: next(
            (r for r in logs.events("step") if float(r["time"]) > at
             and r["world_size"] == 2), None), timeout=120)
        leave = next((r for r in logs.events("regroup") if float(r["time"]) > at), {})
        row = {"yield_admitted_s": round(admitted_s, 2),
               "yield_first_step_at_world_2_s": round(float(step["time"]) - at, 2),
               "yield_pause_s": round(float(leave.get("regroup_s", 0))
                                      + float(leave.get("heal_s", 0)), 3),
               "yield_steps_retrained": steps_retrained(logs, at),
               "yield_stopped": bool(group_starts(logs, at))}
    print(json.dumps(row), flush=True)
    node.kubectl("delete", "trainingjob", job, "-n", ns, "--wait=true", timeout=300)
    queues.delete(node)
    return row


def summarize(rows: list[Record]) -> Record:
    def p50(key: str) -> float | None:
        values = [float(r[key]) for r in rows]
        return round(statistics.median(values), 2) if values else None

    return {"events": len(rows), "freed_s_p50": p50("freed_s"),
            "freed_s_max": max((r["freed_s"] for r in rows), default=None),
            "steps_lost": [r["steps_lost"] for r in rows],
            "plain_suspend_loses": [r["plain_suspend_loses"] for r in rows],
            "back_s_p50": p50("back_s")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=3, help="preemptions")
    parser.add_argument("--interval-steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/kueue_node.json")
    args = parser.parse_args(argv)
    images = prepare_node()
    workdir = Path(tempfile.mkdtemp(prefix="elastrain-kueue-node-"))
    started = time.time()
    with running_node(workdir / "node", images) as node:
        install_operator(node)
        with kueue_running(node, workdir / "kueue"):
            ns = f"bench-kueue-{uuid.uuid4().hex[:4]}"
            create_job_namespace(node, ns)
            queues = Queues(ns)
            queues.create(node)
            node.kubectl.apply(queued_job(
                node, queues, JOB, steps=1_000_000, interval_steps=args.interval_steps,
                recovery={"mode": INPROCESS},
                restartPolicy={"maxRestarts": 100, "backoffSeconds": 1}))
            with LogCollector(node.kubectl, ns, Training.worker_selector(JOB),
                              workdir / "logs") as logs:
                rows = measure(QueuedJob(node.kubectl, ns, JOB, logs, INPROCESS), queues,
                               args.events, args.interval_steps)
            node.kubectl("delete", "trainingjob", JOB, "-n", ns, "--wait=true", timeout=300)
            queues.delete(node)
            yielded = measure_yield(node, workdir / "logs-yield")
    result = {"bench": "kueue_node", "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
              "machine": report.machine(),
              "wall_s": round(time.time() - started, 1), "interval_steps": args.interval_steps,
              "summary": {**summarize(rows), **yielded}, "events": rows}
    return report.write(args.out, result, result["summary"], workdir)


if __name__ == "__main__":
    sys.exit(main())
