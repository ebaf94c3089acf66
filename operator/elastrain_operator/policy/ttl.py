"""Time limits: activeDeadlineSeconds while the job runs, ttlSecondsAfterFinished after it ends.

Both take `now` as an argument; the clock lives in the shell.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from elastrain_operator.model.spec import TrainingJob


def deadline_exceeded(job: TrainingJob, now: datetime) -> bool:
    """True once the job has been active (unsuspended, since status.startTime) too long.
    A suspend clears startTime, so, as for a Kubernetes Job, the clock restarts on resume."""
    limit = job.spec.active_deadline_seconds
    start = job.status.start_time
    if limit is None or start is None:
        return False
    return now >= start + timedelta(seconds=limit)


def ttl_expired(job: TrainingJob, now: datetime) -> bool:
    """True when a finished job has outlived ttlSecondsAfterFinished and should be deleted."""
    ttl = job.spec.ttl_seconds_after_finished
    done = job.status.completion_time
    if ttl is None or done is None or job.status.phase not in ("Succeeded", "Failed"):
        return False
    return now >= done + timedelta(seconds=ttl)
