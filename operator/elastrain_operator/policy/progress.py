"""Training progress as the trainers report it, merged into status.

Progress path: every trainer pod's local rank 0 serves `GET /progress` on spec.metricsPort with
`{"step": int, "totalSteps": int, "loss": float|null, "worldSize": int,
"lastCheckpoint": {"step": int, "uri": str, "time": RFC3339}|null,
"resumedFromStep": int|null, "trainingSince": RFC3339|null, "startedAt": RFC3339|null,
"lastStepTime": RFC3339|null, "validation": {"step": int, "loss": float}|null,
"role": "member"|"spare", "plannedOut": {pod: seconds}, "members": [pod], "spares": [pod],
"storeUnansweredSeconds": float}`
(the last ten are newer: older trainers leave them out; the last five only in-process
trainers send: `role` once a plan named them, `plannedOut` the pods their world planned out
without notice and not back since, with how long ago this trainer saw it (policy.replace acts
on it), `members` and `spares` the pods of its plan (policy.notices waits for a replacement
among them before it moves a worker off a node with a notice), `storeUnansweredSeconds` how
long its heartbeat has not heard the job's store (policy.store replaces a store none hears)).
The operator polls its Ready workers from its per-job ticker (short timeout, failures ignored;
in-process jobs on the control channel, `POST /control` with the job's token and the desired
workers, which answers the same document: how their trainers learn the desired world after a
scale, see probe and control) and keeps the largest step. So the operator needs no
object-store credentials and the workers need no RBAC.

Warm spares (spec.spares): a trainer that waits beyond the world reports role "spare". It trains
no step, so its report never counts as the job's progress, training recovery or liveness
(`member_reports`); it only counts toward status.readySpares (`count_spares`).

Training recovery: trainingSince is when the first step after the worker group's latest
(re)start ended. The first report whose trainingSince is later than the newest counted loss
closes that loss's recovery (status.lastRecovery), exactly once: status remembers which loss
it describes, so an operator restart does not record it again.

Checkpoint health: the newer `checkpointHealth` field is parsed by policy.checkpoints, which
also documents it and derives the CheckpointsFailing condition from it. Likewise the newer
`checkpointFallback` (a resume that skipped a damaged checkpoint) by policy.fallback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import ValidationError

from elastrain_operator.model.status import (
    CheckpointFallback,
    CheckpointRef,
    Progress,
    RecoveryMode,
    TrainingRecovery,
    ValidationLoss,
    WorkerLoss,
)
from elastrain_operator.policy.checkpoints import parse_checkpoint_health
from elastrain_operator.policy.failures import WorkerPod, aware_time
from elastrain_operator.policy.fallback import parse_checkpoint_fallback

Role = Literal["member", "spare"]
ROLES: tuple[Role, ...] = ("member", "spare")


@dataclass(frozen=True)
class ProgressReport:
    progress: Progress
    checkpoint: CheckpointRef | None = None
    started_at: datetime | None = None  # when this trainer process (worker group start) began
    fallback: CheckpointFallback | None = None  # how this start's resume skipped a checkpoint
    role: Role | None = None  # in-process only: in the world, or waiting as a spare
    # In-process only: pod -> seconds since the world planned it out without notice.
    planned_out: Mapping[str, float] = field(default_factory=dict)
    # In-process only: the pods of the plan this trainer is in (members and spares).
    world_pods: frozenset[str] = frozenset()
    # In-process only: the pods of that plan waiting as spares.
    spare_pods: frozenset[str] = frozenset()
    # In-process only: seconds since this trainer's heartbeat last heard the job's store.
    store_unanswered_s: float | None = None

    @property
    def spare(self) -> bool:
        return self.role == "spare"


def parse_progress(payload: Any) -> ProgressReport | None:
    """One /progress document; None when it is not what the contract says."""
    if not isinstance(payload, dict):
        return None
    try:
        progress = Progress(step=payload["step"], total_steps=payload.get("totalSteps", 0),
                            loss=payload.get("loss"), world_size=payload.get("worldSize"),
                            resumed_from_step=payload.get("resumedFromStep"),
                            training_since=payload.get("trainingSince"),
                            last_step_time=payload.get("lastStepTime"),
                            checkpoint_health=parse_checkpoint_health(
                                payload.get("checkpointHealth")),
                            validation=_validation(payload.get("validation")))
        ckpt_raw = payload.get("lastCheckpoint")
        ckpt = CheckpointRef.model_validate(ckpt_raw) if ckpt_raw else None
        started = payload.get("startedAt")
        started_at = _aware(started) if started else None
    except (KeyError, TypeError, ValueError, ValidationError):
        return None
    return ProgressReport(progress=progress, checkpoint=ckpt, started_at=started_at,
                          fallback=parse_checkpoint_fallback(payload.get("checkpointFallback")),
                          role=_role(payload.get("role")),
                          planned_out=_planned_out(payload.get("plannedOut")),
                          world_pods=_pods(payload.get("members")) | _pods(payload.get("spares")),
                          spare_pods=_pods(payload.get("spares")),
                          store_unanswered_s=_seconds(payload.get("storeUnansweredSeconds")))


def _role(raw: Any) -> Role | None:
    """The newer "role" field; anything but a known role is dropped, not the whole report."""
    return next((r for r in ROLES if r == raw), None)


def _planned_out(raw: Any) -> dict[str, float]:
    """The newer "plannedOut" field; entries that are not pod -> seconds are dropped."""
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, raw_v in raw.items() if isinstance(k, str) and len(k) <= 253
            and (v := _seconds(raw_v)) is not None}


def _seconds(raw: Any) -> float | None:
    """A newer field of seconds; anything but a plausible number is dropped."""
    if isinstance(raw, int | float) and not isinstance(raw, bool) and 0 <= raw < 1e9:
        return float(raw)
    return None


def _pods(raw: Any) -> frozenset[str]:
    """The newer "members"/"spares" fields: pod names; anything else is dropped."""
    if not isinstance(raw, list):
        return frozenset()
    return frozenset(p for p in raw[:1024] if isinstance(p, str) and 0 < len(p) <= 253)


def member_reports(reports: Sequence[ProgressReport] | None,
                   ) -> tuple[ProgressReport, ...] | None:
    """The reports of trainers in the world: a spare steps no step, so its step, start and
    trainingSince say nothing about the job's training (None stays None: nothing polled)."""
    if reports is None:
        return None
    return tuple(r for r in reports if not r.spare)


def count_spares(reports: Sequence[ProgressReport]) -> int:
    return sum(r.spare for r in reports)


def _validation(raw: Any) -> ValidationLoss | None:
    """The newer "validation" field; a malformed one is dropped, not the whole report."""
    if not isinstance(raw, dict):
        return None
    try:
        return ValidationLoss(step=raw["step"], loss=raw["loss"])
    except (KeyError, TypeError, ValueError, ValidationError):
        return None


def _aware(text: str) -> datetime:
    parsed = aware_time(text)
    if parsed is None:
        raise ValueError(f"{text!r} is not a time with a zone")
    return parsed


def final_reports(workers: Sequence[WorkerPod]) -> tuple[ProgressReport, ...]:
    """The last progress of trainers that finished: local rank 0 writes its /progress document
    into the container's termination message on success (elastrain_trainer.metrics), because it
    exits before the next poll could read its final checkpoint."""
    reports = []
    for pod in workers:
        if pod.phase != "Succeeded" or not pod.exit_message.startswith("{"):
            continue
        try:
            payload = json.loads(pod.exit_message)
        except ValueError:
            continue
        if (report := parse_progress(payload)) is not None:
            reports.append(report)
    return tuple(reports)


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
    goes backwards, even when every worker that knew it is gone; the validation loss is the
    newest any report or the previous status has (a restarted trainer has none until it
    evaluates again)."""
    if not reports:
        return previous, last_checkpoint
    best = max(reports, key=lambda r: r.progress.step)
    checkpoint = last_checkpoint
    for report in reports:
        checkpoint = _newer(checkpoint, report.checkpoint)
    known = [v for v in (previous.validation if previous else None,
                         *(r.progress.validation for r in reports)) if v is not None]
    validation = max(known, key=lambda v: v.step, default=None)
    if validation != best.progress.validation:
        return best.progress.model_copy(update={"validation": validation}), checkpoint
    return best.progress, checkpoint


def derive_training_recovery(previous: TrainingRecovery | None, losses: Sequence[WorkerLoss],
                             reports: Sequence[ProgressReport] | None, *,
                             mode: RecoveryMode = "Restart") -> TrainingRecovery | None:
    """The recovery of the newest counted loss when these reports first show training after
    it; None when there is nothing new to record."""
    if not losses or not reports:
        return None
    # Several losses before one resume: the resume answers them all, so it is measured from the
    # newest one; the older ones get no recovery of their own.
    loss = losses[-1]
    if previous is not None and (previous.lost_at, previous.pod) == (loss.time, loss.pod):
        return None
    # A trainingSince before the loss is from a start the loss interrupted (or preceded).
    resumes = [(p.training_since, p) for p in (r.progress for r in reports)
               if p.training_since is not None and p.training_since > loss.time]
    if not resumes:
        return None
    # Every rank of a worker group ends its first step together; the earliest report is it.
    training_at, first = min(resumes, key=lambda pair: pair[0])
    return TrainingRecovery(lost_at=loss.time, training_at=training_at,
                            seconds=(training_at - loss.time).total_seconds(), kind=loss.kind,
                            pod=loss.pod, resumed_from_step=first.resumed_from_step, mode=mode)
