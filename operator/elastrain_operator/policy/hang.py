"""The progress watchdog: a job whose workers complete no training step for too long is hung.

A stuck collective (a peer that stopped answering without dying), a deadlocked data loader or a
wedged storage read leaves every process alive: no pod exits, nothing is counted, and the job
would show Running until the process group's timeout, or forever. Each trainer's /progress says
when its process started (`startedAt`) and when its latest step ended (`lastStepTime`); the
/progress server is a thread of its own, so it keeps answering while the training loop is stuck.

The job is hung when spec.hangTimeoutSeconds (0: off) have passed since the newest of those
times across the Ready workers polled this round (members only: a warm spare steps no step, so
the planner leaves its report out; it can neither hide a hang nor make one). Then the Hung
condition turns True (Warning event NoTrainingProgress), and every current worker is restarted
as ONE counted failure (a hang is the job's own fault as far as anyone can tell, and must spend
the same budget): their slots
get a new attempt in the status write that counts it, so the deleted pods are not mistaken for
preemptions, and the replacements wait for the failure's backoff like any other. A round with no
report (metricsPort 0, no worker Ready, polling off) never decides a hang. Hung turns False
(TrainingProgressing) once a report shows a step that ended after the condition turned True.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from elastrain_operator.model.status import Condition
from elastrain_operator.policy.progress import ProgressReport


def last_activity(reports: Sequence[ProgressReport]) -> datetime | None:
    """The newest start or step end any trainer reported; None when none says either."""
    times = [t for r in reports for t in (r.started_at, r.progress.last_step_time)
             if t is not None]
    return max(times) if times else None


def stalled_seconds(reports: Sequence[ProgressReport] | None, *, timeout_seconds: int,
                    now: datetime) -> float | None:
    """Seconds without a step when that is at least the timeout (the job is hung); else None."""
    if not timeout_seconds or not reports:
        return None
    since = last_activity(reports)
    if since is None:
        return None
    stalled = (now - since).total_seconds()
    return stalled if stalled >= timeout_seconds else None


def progressing_again(hung: Condition | None,
                      reports: Sequence[ProgressReport] | None) -> bool:
    """A True Hung condition is over once a step ended after it turned True."""
    if hung is None or hung.status != "True" or not reports:
        return False
    steps = [r.progress.last_step_time for r in reports if r.progress.last_step_time]
    return any(t > hung.last_transition_time for t in steps)
