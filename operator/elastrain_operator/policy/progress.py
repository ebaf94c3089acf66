"""Training progress as the trainers report it, merged into status.

Progress path: every trainer pod's local rank 0 serves `GET /progress` on spec.metricsPort with
`{"step": int, "totalSteps": int, "loss": float|null, "worldSize": int,
"lastCheckpoint": {"step": int, "uri": str, "time": RFC3339}|null}`. The operator polls its
Ready workers from its timer (short timeout, failures ignored) and keeps the largest step. So
the operator needs no object-store credentials and the workers need no RBAC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from elastrain_operator.model.status import CheckpointRef, Progress


@dataclass(frozen=True)
class ProgressReport:
    progress: Progress
    checkpoint: CheckpointRef | None = None


def parse_progress(payload: Any) -> ProgressReport | None:
    """One /progress document; None when it is not what the contract says."""
    if not isinstance(payload, dict):
        return None
    try:
        progress = Progress(step=payload["step"], total_steps=payload.get("totalSteps", 0),
                            loss=payload.get("loss"), world_size=payload.get("worldSize"))
        ckpt_raw = payload.get("lastCheckpoint")
        ckpt = CheckpointRef.model_validate(ckpt_raw) if ckpt_raw else None
    except (KeyError, TypeError, ValueError, ValidationError):
        return None
    return ProgressReport(progress=progress, checkpoint=ckpt)


def _newer(a: CheckpointRef | None, b: CheckpointRef | None) -> CheckpointRef | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if _order(b) > _order(a) else a


def _order(ref: CheckpointRef) -> tuple[int, float]:
    return ref.step, ref.time.timestamp() if ref.time else 0.0


def merge_progress(previous: Progress | None, last_checkpoint: CheckpointRef | None,
                   reports: Sequence[ProgressReport] | None,
                   ) -> tuple[Progress | None, CheckpointRef | None]:
    """The furthest report wins (workers that just joined may lag); the last checkpoint never
    goes backwards, even when every worker that knew it is gone."""
    if not reports:
        return previous, last_checkpoint
    best = max(reports, key=lambda r: r.progress.step)
    checkpoint = last_checkpoint
    for report in reports:
        checkpoint = _newer(checkpoint, report.checkpoint)
    return best.progress, checkpoint
