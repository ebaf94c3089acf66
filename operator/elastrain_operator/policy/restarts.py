"""The job's two budgets and the backoff between replacements of failed workers.

Failures of the job's own making (a worker exiting non-zero) count in status.restarts against
restartPolicy.maxRestarts and delay the replacement exponentially; losses to the platform count
in status.preemptions against maxPreemptions (unset: unlimited) and are replaced at once.
A budget of N tolerates N counted events: the job fails on the (N+1)th.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from elastrain_operator.model import conditions as c
from elastrain_operator.model.spec import RestartPolicy


def backoff_seconds(policy: RestartPolicy, restarts: int) -> int:
    """Delay before replacing a worker after the `restarts`-th counted failure (1-based):
    backoffSeconds doubling per failure, capped at maxBackoffSeconds."""
    if restarts < 1 or policy.backoff_seconds == 0:
        return 0
    # Cap the exponent first: 2**restarts for a large count is a huge int for nothing.
    doubled: int = policy.backoff_seconds << min(restarts - 1, 32)
    return min(doubled, policy.max_backoff_seconds)


def backoff_until(policy: RestartPolicy, restarts: int, now: datetime) -> datetime | None:
    delay = backoff_seconds(policy, restarts)
    return now + timedelta(seconds=delay) if delay else None


def exhausted_budget(policy: RestartPolicy, *, restarts: int, preemptions: int,
                     last_failure: str = "") -> tuple[str, str] | None:
    """(reason, message) when a budget is spent, else None; last_failure (why the newest
    failed worker failed, e.g. the trainer's exception) ends the MaxRestartsExceeded message."""
    if restarts > policy.max_restarts:
        return (c.MAX_RESTARTS_EXCEEDED,
                f"{restarts} worker failures exceed spec.restartPolicy.maxRestarts "
                f"({policy.max_restarts})" + (f"; last: {last_failure}" if last_failure else ""))
    if policy.max_preemptions is not None and preemptions > policy.max_preemptions:
        return (c.MAX_PREEMPTIONS_EXCEEDED,
                f"{preemptions} preemptions exceed spec.restartPolicy.maxPreemptions "
                f"({policy.max_preemptions})")
    return None
