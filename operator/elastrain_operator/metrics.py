"""The operator's Prometheus metrics, behind record_* functions (labels are bounded).

elastrain_operator_jobs{phase}                       gauge, TrainingJobs by phase (this replica)
elastrain_operator_workers_desired                   gauge, desired workers over all jobs
elastrain_operator_workers_ready                     gauge, Ready workers over all jobs
elastrain_operator_reconcile_total{result}           counter, result: success|conflict|error
elastrain_operator_reconcile_errors_total            counter
elastrain_operator_reconcile_duration_seconds        histogram
elastrain_operator_workers_created_total             counter
elastrain_operator_restarts_total                    counter, worker failures counted
elastrain_operator_preemptions_total                 counter, workers lost to preemption
elastrain_operator_recovery_seconds                  histogram, worker lost -> full size again
elastrain_operator_training_recovery_seconds         histogram, worker lost -> first training
                                                     step after the resume
elastrain_operator_tickers                           gauge, per-job tickers running (one per
                                                     live job; 0 on a paused replica)
"""

from __future__ import annotations

import threading
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PREFIX: Final = "elastrain_operator_"
PHASES: Final = ("Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
REGISTRY = CollectorRegistry(auto_describe=True)

_jobs = Gauge(f"{PREFIX}jobs", "TrainingJobs by phase", ["phase"], registry=REGISTRY)
_desired = Gauge(f"{PREFIX}workers_desired", "Desired workers over all jobs", registry=REGISTRY)
_ready = Gauge(f"{PREFIX}workers_ready", "Ready workers over all jobs", registry=REGISTRY)
_reconciles = Counter(f"{PREFIX}reconcile", "Reconciles by result", ["result"],
                      registry=REGISTRY)
_errors = Counter(f"{PREFIX}reconcile_errors", "Reconciles that raised", registry=REGISTRY)
_duration = Histogram(f"{PREFIX}reconcile_duration_seconds", "Time of one reconcile",
                      buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                      registry=REGISTRY)
_created = Counter(f"{PREFIX}workers_created", "Worker pods created", registry=REGISTRY)
_restarts = Counter(f"{PREFIX}restarts", "Worker failures counted against maxRestarts",
                    registry=REGISTRY)
_preemptions = Counter(f"{PREFIX}preemptions", "Workers lost to preemption or disruption",
                       registry=REGISTRY)
_hangs = Counter(f"{PREFIX}hangs", "Jobs restarted by the progress watchdog "
                 "(no step for spec.hangTimeoutSeconds)", registry=REGISTRY)
_recovery = Histogram(f"{PREFIX}recovery_seconds", "From a worker's loss to full size again",
                      buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
                      registry=REGISTRY)
_training_recovery = Histogram(
    f"{PREFIX}training_recovery_seconds",
    "From a worker's loss to the first training step after the resume",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800), registry=REGISTRY)

_tickers = Gauge(f"{PREFIX}tickers", "Per-job tickers running (one per live job)",
                 registry=REGISTRY)

_phase_lock = threading.Lock()
# job uid -> (phase, desired, ready): totals over jobs without listing them on every scrape.
_jobs_seen: dict[str, tuple[str, int, int]] = {}
for _phase in PHASES:
    _jobs.labels(phase=_phase).set(0)


def record_reconcile(result: str, seconds: float) -> None:
    _reconciles.labels(result=result).inc()
    _duration.observe(seconds)
    if result == "error":
        _errors.inc()


def record_workers_created(count: int) -> None:
    if count:
        _created.inc(count)


def record_hang() -> None:
    _hangs.inc()


def record_losses(*, restarts: int, preemptions: int) -> None:
    if restarts:
        _restarts.inc(restarts)
    if preemptions:
        _preemptions.inc(preemptions)


def record_recovery(seconds: float) -> None:
    _recovery.observe(seconds)


def record_training_recovery(seconds: float) -> None:
    _training_recovery.observe(seconds)


def record_tickers(count: int) -> None:
    _tickers.set(count)


def record_job(uid: str, phase: str | None, *, desired: int = 0, ready: int = 0) -> None:
    """The job's latest phase and worker counts; phase None forgets it (it was deleted)."""
    with _phase_lock:
        if phase is None:
            _jobs_seen.pop(uid, None)
        else:
            _jobs_seen[uid] = (phase, desired, ready)
        counts = dict.fromkeys(PHASES, 0)
        for seen_phase, _, _ in _jobs_seen.values():
            counts[seen_phase] = counts.get(seen_phase, 0) + 1
        total_desired = sum(d for _, d, _ in _jobs_seen.values())
        total_ready = sum(r for _, _, r in _jobs_seen.values())
    for p, n in counts.items():
        _jobs.labels(phase=p).set(n)
    _desired.set(total_desired)
    _ready.set(total_ready)


def serve(port: int) -> None:
    """Expose /metrics on `port` (0: do not serve)."""
    if port:
        start_http_server(port, registry=REGISTRY)
