"""Checkpoint health: the CheckpointsFailing condition, from what the trainers report.

Each trainer counts the checkpoint saves, and the start-up checks of the checkpoint location,
that failed since the last one that succeeded, and reports it in /progress as
`"checkpointHealth": {"consecutiveFailures": int, "lastError": str|null,
"lastFailureTime": RFC3339|null}|null` (null until its first save or check; older trainers leave
it out). It lands in status.progress.checkpointHealth with the rest of the furthest report
(policy.progress); a DCP save is collective, so every rank sees the same outcome.

CheckpointsFailing is True (reason CheckpointSaveFailed, the diagnosis in its message: what
failed where, the endpoint and the credential source) while that count is above zero, False
(CheckpointsHealthy) once a save commits or a start-up check passes, and absent until a trainer
reports health at all. Its transitions are announced by policy.status as events: a Warning when
it turns True, a Normal one when it clears; once per transition, however often the trainers are
polled, since events come from comparing the written conditions.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from elastrain_operator.model import conditions as c
from elastrain_operator.model.status import CheckpointHealth, CheckpointRef, Progress

MAX_ERROR = 1024


def parse_checkpoint_health(raw: Any) -> CheckpointHealth | None:
    """The checkpointHealth of one /progress document; None when absent or malformed (the rest
    of the report still counts)."""
    if not isinstance(raw, dict):
        return None
    try:
        return CheckpointHealth(
            consecutive_failures=raw.get("consecutiveFailures", 0),
            last_error=str(raw.get("lastError") or "")[:MAX_ERROR],
            last_failure_time=raw.get("lastFailureTime"))
    except (TypeError, ValueError, ValidationError):
        return None


def checkpoints_condition(progress: Progress | None, last: CheckpointRef | None,
                          ) -> tuple[bool, str, str] | None:
    """(status, reason, message) of CheckpointsFailing; None: nothing reported, keep it as is."""
    health = progress.checkpoint_health if progress is not None else None
    if health is None:
        return None
    committed = ("no checkpoint committed yet" if last is None else
                 f"last committed checkpoint: step {last.step}"
                 + (f" at {last.time.isoformat()}" if last.time else ""))
    n = health.consecutive_failures
    if n == 0:
        return False, c.CHECKPOINTS_HEALTHY, f"checkpoint saves succeed; {committed}"
    when = f" at {health.last_failure_time.isoformat()}" if health.last_failure_time else ""
    return (True, c.CHECKPOINT_SAVE_FAILED,
            f"{n} consecutive checkpoint save(s) or checks failed, the latest{when}: "
            f"{health.last_error or 'no error reported'}; {committed}")
