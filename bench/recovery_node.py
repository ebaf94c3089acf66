"""Recovery on the real node: a TrainingJob's worker pods evicted one at a time, as a spot
notice handler or a drain does, on the one-node cluster the e2e tier uses (kubelet,
containerd, the operator installed by its chart, MinIO on the pod bridge).

    sudo .venv/bin/python bench/recovery_node.py [--events 12] [--out ...]
    make bench-recovery-node          # root; ~15 min here with the images cached

The job is the e2e suite's (tests/e2e/support.make_job: the kind example, 3 workers, min 2,
DDP over gloo, the tiny GPT paced at 0.25 s a step, checkpoints to MinIO every 20 steps).
Each event waits until the job is back at full size and training, then evicts one worker
through the Eviction API, rotating over worker indices 0, 1, 2 (worker 0 would host the
rendezvous under torchrun's default; here the job's own store does). Per event, from the
trainers' own records (one JSON object per stdout line, followed from every pod's log):
recovery = eviction -> first training step after the resume, where the time went (the
SIGTERM save committed, the new workers up, the checkpoint loaded; bench/goodput.py's
recovery_phases), and steps lost (last step trained before the eviction - the step the
resume loaded). The job's status counters must show one preemption per event and no failure.
Writes bench/results/recovery_node.json; summarised in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.goodput import recovery_phases  # noqa: E402
from tests.e2e.conftest import (  # noqa: E402
    create_job_namespace,
    install_operator,
    prepare_node,
    running_node,
)
from tests.e2e.support import (  # noqa: E402
    LogCollector,
    Training,
    make_job,
    steps_lost_at,
    wait_for,
)

JOB = "recovery"
REPLICAS = 3


def measure(t: Training, events: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(events):
        t.settle(REPLICAS)
        before = t.counters()
        index = i % REPLICAS
        pod = t.worker(index)
        at = t.evict(pod)
        first = t.resumed_after(at)
        wait_for("the preemption counted",
                 lambda: t.counters()[0] > before[0], timeout=60)  # noqa: B023 (called here)
        row = {"event": i + 1, "worker_index": index, "pod": pod,
               "recovery_s": round(float(first["time"]) - at, 3),
               "resumed_from_step": int(first["step"]) - 1,
               "steps_lost": steps_lost_at(t.logs, at),
               "phases_s": recovery_phases(list(t.logs.records), at),
               "counted": [a - b for a, b in zip(t.counters(), before, strict=True)]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    t.settle(REPLICAS)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rec = [float(r["recovery_s"]) for r in rows]
    lost = [int(r["steps_lost"]) for r in rows]

    def phase(name: str) -> float | None:
        values = [r["phases_s"][name] for r in rows if r["phases_s"].get(name) is not None]
        return None if not values else round(statistics.median(values), 2)

    by_index = {str(i): round(statistics.median(
        [float(r["recovery_s"]) for r in rows if r["worker_index"] == i]), 2)
        for i in sorted({int(r["worker_index"]) for r in rows})}
    return {"events": len(rows),
            "recovery_p50_s": round(statistics.median(rec), 2),
            "recovery_max_s": round(max(rec), 2),
            "recovery_p50_by_worker_index_s": by_index,
            "phases_p50_s": {name: phase(name) for name in
                             ("saved", "workers_up", "resumed", "first_step")},
            "steps_lost_max": max(lost),
            "preemptions_counted": sum(r["counted"][0] for r in rows),
            "failures_counted": sum(r["counted"][1] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/recovery_node.json")
    args = parser.parse_args(argv)
    images = prepare_node()
    workdir = Path(tempfile.mkdtemp(prefix="elastrain-recovery-node-"))
    with running_node(workdir / "node", images) as node:
        install_operator(node)
        ns = f"bench-recovery-{uuid.uuid4().hex[:4]}"
        create_job_namespace(node, ns)
        node.kubectl.apply(make_job(JOB, ns, image=node.images["trainer"], steps=1_000_000,
                                    s3_endpoint=node.s3.endpoint_url, bucket=node.s3.bucket))
        started = time.time()
        with LogCollector(node.kubectl, ns, Training.worker_selector(JOB),
                          workdir / "logs") as logs:
            rows = measure(Training(node.kubectl, ns, JOB, logs), args.events)
    result = {"bench": "recovery_node", "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
              "machine": {"cpus": len(os.sched_getaffinity(0)),
                          "kernel": platform.release(), "python": platform.python_version()},
              "wall_s": round(time.time() - started, 1),
              "summary": summarize(rows), "events": rows}
    print(json.dumps(result["summary"], indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"logs: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
