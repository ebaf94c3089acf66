"""Checkpoint fallback: /progress's checkpointFallback -> status.checkpointFallback -> the
CheckpointFallback condition, one Warning event per fallback, `elastrain describe`
(policy/fallback.py, policy/status.py)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from elastrain_operator.describe import describe_job
from elastrain_operator.model import conditions as c
from elastrain_operator.model.status import CheckpointFallback
from elastrain_operator.policy.fallback import (
    fallback_condition,
    newest_fallback,
    parse_checkpoint_fallback,
)
from elastrain_operator.policy.planning import Plan
from elastrain_operator.policy.progress import ProgressReport, parse_progress
from tests.unit.operator.test_checkpoints import conditions, running
from tests.unit.operator.test_planning import T0

SKIPPED = "s3://b/j/step-00000012"
LOADED = "s3://b/j/step-00000008"
WHY = "checksum mismatch of __0_0.distcp: sha256 0f3a... in the manifest, 9c1e... read"


def fallback(*, skipped: int = 12, loaded: int | None = 8, at: str = "2026-01-01T00:00:30Z",
             **overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "skippedStep": skipped, "skippedUri": f"s3://b/j/step-{skipped:08d}", "reason": WHY,
        "loadedStep": loaded, "loadedUri": None if loaded is None else f"s3://b/j/step-{loaded:08d}",
        "stepsLost": skipped - (loaded or 0), "quarantined": True, "time": at}
    return {**doc, **overrides}


def report(step: int, checkpoint_fallback: Any = None, *, absent: bool = False) -> ProgressReport:
    doc: dict[str, Any] = {"step": step, "totalSteps": 100, "loss": 1.0, "worldSize": 2}
    if not absent:
        doc["checkpointFallback"] = checkpoint_fallback
    parsed = parse_progress(doc)
    assert parsed is not None
    return parsed


def warnings(p: Plan) -> list[Any]:
    return [e for e in p.events if e.reason == c.DAMAGED_CHECKPOINT_SKIPPED]


def test_parse_reads_the_contract() -> None:
    parsed = parse_checkpoint_fallback(fallback())
    assert parsed == CheckpointFallback(
        skipped_step=12, skipped_uri=SKIPPED, reason=WHY, loaded_step=8, loaded_uri=LOADED,
        steps_lost=4, quarantined=True, time=T0 + timedelta(seconds=30))
    fresh = parse_checkpoint_fallback(fallback(loaded=None, quarantined=False))
    assert fresh is not None
    assert (fresh.loaded_step, fresh.loaded_uri, fresh.steps_lost) == (None, None, 12)
    assert not fresh.quarantined
    long = parse_checkpoint_fallback(fallback(reason="x" * 5000))
    assert long is not None and len(long.reason) == 600
    # Reported by every rank of a resume: the report carries it, the rest of it intact.
    rep = report(7, fallback())
    assert rep.progress.step == 7 and rep.fallback == parsed


@pytest.mark.parametrize("raw", [
    None, "fell back", [fallback()], {},
    fallback(skippedStep="twelve"), fallback(skippedStep=-1), fallback(stepsLost=-4),
    fallback(time="yesterday"), fallback(time="2026-01-01T00:00:30"),  # no zone
    fallback(quarantined="maybe"), fallback(skippedUri=None),
    {k: v for k, v in fallback().items() if k != "time"},
    {k: v for k, v in fallback().items() if k != "skippedUri"},
])
def test_a_malformed_or_absent_fallback_is_ignored_and_the_report_still_counts(raw: Any) -> None:
    assert parse_checkpoint_fallback(raw) is None
    rep = report(7, raw)
    assert rep.progress.step == 7 and rep.fallback is None
    assert report(7, absent=True).fallback is None  # an older trainer


def test_the_newest_fallback_wins_and_an_older_one_never_comes_back() -> None:
    first = parse_checkpoint_fallback(fallback(at="2026-01-01T00:00:30Z"))
    later = parse_checkpoint_fallback(fallback(skipped=20, loaded=16,
                                               at="2026-01-01T00:05:00Z"))
    assert first is not None and later is not None
    assert newest_fallback(None, []) is None
    assert newest_fallback(None, [None, None]) is None
    assert newest_fallback(None, [first, first]) == first  # every rank reports the same one
    assert newest_fallback(first, [first, None]) is None  # already stored
    assert newest_fallback(first, [first, later]) == later
    assert newest_fallback(later, [first]) is None  # a worker of an earlier start


def test_condition_and_its_message() -> None:
    assert fallback_condition(None) is None
    got = fallback_condition(parse_checkpoint_fallback(fallback()))
    assert got == (True, c.DAMAGED_CHECKPOINT_SKIPPED,
                   f"at 2026-01-01T00:00:30+00:00 skipped the damaged checkpoint of step 12 "
                   f"({SKIPPED}): {WHY}; resumed from step 8 ({LOADED}); 4 step(s) lost; "
                   "quarantined (kept for a post-mortem, never loaded again)")
    fresh = fallback_condition(parse_checkpoint_fallback(fallback(loaded=None, quarantined=False)))
    assert fresh is not None
    assert ("no usable checkpoint left, started from step 0; 12 step(s) lost; not quarantined"
            in fresh[2])


def test_a_fallback_is_kept_in_status_with_one_warning_event_and_survives_null_reports() -> None:
    w = running()
    assert c.CHECKPOINT_FALLBACK not in conditions(w) and "checkpointFallback" not in w.status

    p = w.reconcile(T0 + timedelta(seconds=31), progress=(report(9, fallback()),
                                                          report(9, fallback())))
    stored = w.status["checkpointFallback"]
    assert stored == {"skippedStep": 12, "skippedUri": SKIPPED, "reason": WHY, "loadedStep": 8,
                      "loadedUri": LOADED, "stepsLost": 4, "quarantined": True,
                      "time": "2026-01-01T00:00:30Z"}
    cond = conditions(w)[c.CHECKPOINT_FALLBACK]
    assert (cond["status"], cond["reason"]) == ("True", c.DAMAGED_CHECKPOINT_SKIPPED)
    assert f"step 12 ({SKIPPED}): {WHY}; resumed from step 8" in cond["message"]
    (event,) = warnings(p)  # two ranks reported it: one event
    assert event.type == "Warning" and event.message == f"CheckpointFallback=True: " \
                                                        f"{cond['message']}"
    assert not [e for e in p.events if c.CHECKPOINT_FALLBACK in e.message and e is not event]

    # Polled again, the same fallback; then a later start that resumed normally (null), an
    # older trainer (absent), nobody answering: kept, still True, no second event.
    for i, progress in enumerate([(report(10, fallback()),), (report(11, None),),
                                  (report(12, absent=True),), ()], start=32):
        p = w.reconcile(T0 + timedelta(seconds=i), progress=progress)
        assert not warnings(p), i
        assert w.status["checkpointFallback"] == stored
        assert conditions(w)[c.CHECKPOINT_FALLBACK] == cond


def test_a_newer_fallback_replaces_the_message_and_is_told_again() -> None:
    w = running()
    w.reconcile(T0 + timedelta(seconds=31), progress=(report(9, fallback()),))
    first = conditions(w)[c.CHECKPOINT_FALLBACK]
    p = w.reconcile(T0 + timedelta(seconds=400), progress=(report(17, fallback(
        skipped=20, loaded=None, at="2026-01-01T00:05:00Z")),))
    cond = conditions(w)[c.CHECKPOINT_FALLBACK]
    assert cond["status"] == "True" and cond["lastTransitionTime"] == first["lastTransitionTime"]
    assert "step 20" in cond["message"] and "started from step 0; 20 step(s) lost" in \
        cond["message"]
    assert w.status["checkpointFallback"]["stepsLost"] == 20
    (event,) = warnings(p)
    assert "step 20" in event.message
    # A worker of the earlier start still reports the first one: it does not come back.
    p = w.reconcile(T0 + timedelta(seconds=401), progress=(report(18, fallback()),))
    assert not warnings(p) and w.status["checkpointFallback"]["skippedStep"] == 20


def test_a_finished_workers_final_report_tells_its_fallback() -> None:
    """A trainer that finished before any poll saw its resume: its termination message tells."""
    w = running()
    final = json.dumps({"step": 100, "totalSteps": 100, "checkpointFallback": fallback()})
    for name in w.workers():
        w.set_pod(name, "Succeeded", exit_code=0, message=final)
    p = w.reconcile(T0 + timedelta(seconds=40))
    assert w.status["phase"] == "Succeeded"
    assert w.status["checkpointFallback"]["skippedStep"] == 12
    assert len(warnings(p)) == 1


def test_describe_shows_the_fallback() -> None:
    w = running()
    assert "Checkpoint fallback" not in describe_job(w.job, [])
    w.reconcile(T0 + timedelta(seconds=31), progress=(report(9, fallback()),))
    text = describe_job(w.job, [])
    assert (f"Checkpoint fallback: at 2026-01-01T00:00:30+00:00 skipped the damaged checkpoint "
            f"of step 12 ({SKIPPED}): {WHY}; resumed from step 8 ({LOADED}); 4 step(s) lost; "
            "quarantined (kept for a post-mortem, never loaded again)\n") in text
