"""A stand-in process that serves the real metrics modules on loopback for the dashboard test.

    python exporters.py operator PORT     elastrain_operator.metrics.REGISTRY
    python exporters.py trainer PORT      elastrain_trainer.metrics (its own /metrics server)

It calls their record_* functions in a loop, like a busy operator and a training run with
checkpoints and restarts, so that every rate and quantile the dashboard asks for has data.
"""

from __future__ import annotations

import math
import sys
import time


def run_operator(port: int) -> None:
    from prometheus_client import start_http_server

    from elastrain_operator import metrics

    # metrics.serve() binds every interface; the test keeps everything on loopback.
    start_http_server(port, addr="127.0.0.1", registry=metrics.REGISTRY)
    phases = ("Running", "Running", "Restarting", "Pending", "Succeeded")
    tick = 0
    while True:
        tick += 1
        metrics.record_reconcile("success" if tick % 7 else "error", 0.01 * (tick % 5 + 1))
        metrics.record_job(f"uid-{tick % 5}", phases[tick % len(phases)], desired=4,
                           ready=3 + tick % 2)
        metrics.record_workers_created(tick % 2)
        metrics.record_losses(restarts=tick % 2, preemptions=1)
        metrics.record_recovery(5.0 + tick % 20)
        time.sleep(0.2)


def run_trainer(port: int) -> None:
    from elastrain_trainer import metrics

    metrics.serve(port, host="127.0.0.1")
    step = 0
    while True:
        step += 1
        metrics.record_start(total_steps=100_000, world_size=2, restarts=1 if step % 25 == 0 else 0)
        metrics.record_step(step, loss=4.0 * math.exp(-step / 500) + 1.0, duration_s=0.05,
                            tokens=8 * 128)
        metrics.record_goodput(0.93)
        if step % 5 == 0:
            metrics.record_checkpoint_save(1.5)
            metrics.record_checkpoint_written_bytes(10_000_000)
            metrics.record_committed(step, f"s3://bucket/run/step-{step}",
                                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if step % 10 == 0:
            metrics.record_checkpoint_load(0.7)
        time.sleep(0.1)


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    {"operator": run_operator, "trainer": run_trainer}[role](port)
