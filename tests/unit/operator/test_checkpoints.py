"""Checkpoint health: /progress's checkpointHealth -> status.progress -> CheckpointsFailing, and
one event per transition (policy/checkpoints.py, policy/status.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from elastrain_operator.describe import describe_job
from elastrain_operator.model import conditions as c
from elastrain_operator.model.status import CheckpointHealth, CheckpointRef, Progress
from elastrain_operator.policy.checkpoints import checkpoints_condition, parse_checkpoint_health
from elastrain_operator.policy.progress import parse_progress
from tests.unit.operator.test_planning import T0, World

ERROR = ("save s3://b/j/step-00000040 failed: NoSuchBucket: bucket 'b' does not exist at this "
         "endpoint (endpoint http://minio:9000, access key ****2246 from environment variables)")


def health(failures: int, error: str = ERROR, at: str = "2026-01-01T00:00:30Z") -> dict[str, Any]:
    return {"consecutiveFailures": failures, "lastError": error if failures else None,
            "lastFailureTime": at if failures else None}


def report(step: int, checkpoint_health: dict[str, Any] | None) -> Any:
    doc: dict[str, Any] = {"step": step, "totalSteps": 100, "loss": 1.0, "worldSize": 2,
                           "lastCheckpoint": {"step": 20, "uri": "s3://b/j/step-00000020",
                                              "time": "2026-01-01T00:00:10Z"}}
    if checkpoint_health is not None:
        doc["checkpointHealth"] = checkpoint_health
    parsed = parse_progress(doc)
    assert parsed is not None
    return parsed


def running() -> World:
    w = World.new()
    w.reconcile(T0)
    w.run_all()
    w.reconcile(T0)
    return w


def conditions(w: World) -> dict[str, dict[str, Any]]:
    return {x["type"]: x for x in w.status["conditions"]}


def test_parse_reads_the_contract_and_drops_only_a_malformed_health() -> None:
    parsed = parse_checkpoint_health(health(3))
    assert parsed == CheckpointHealth(consecutive_failures=3, last_error=ERROR,
                                      last_failure_time=T0 + timedelta(seconds=30))
    assert parse_checkpoint_health(None) is None
    assert parse_checkpoint_health("3 failures") is None
    assert parse_checkpoint_health({"consecutiveFailures": -1}) is None
    assert parse_checkpoint_health({"consecutiveFailures": "many"}) is None
    assert parse_checkpoint_health({"consecutiveFailures": 1, "lastFailureTime": "yesterday"}) \
        is None
    long = parse_checkpoint_health({"consecutiveFailures": 1, "lastError": "x" * 5000})
    assert long is not None and len(long.last_error) == 1024
    # A malformed health does not cost the rest of the report.
    rep = report(7, {"consecutiveFailures": "many"})
    assert rep.progress.step == 7 and rep.progress.checkpoint_health is None
    assert report(7, health(0)).progress.checkpoint_health == CheckpointHealth()


def test_condition_is_true_while_saves_fail_and_absent_until_reported() -> None:
    last = CheckpointRef(step=20, uri="s3://b/j/step-00000020", time=T0)
    assert checkpoints_condition(None, last) is None
    assert checkpoints_condition(Progress(step=5), last) is None  # an older trainer
    ok = checkpoints_condition(Progress(checkpoint_health=CheckpointHealth()), None)
    assert ok == (False, c.CHECKPOINTS_HEALTHY,
                  "checkpoint saves succeed; no checkpoint committed yet")
    failing = checkpoints_condition(
        Progress(checkpoint_health=parse_checkpoint_health(health(2))), last)
    assert failing is not None
    status, reason, message = failing
    assert (status, reason) == (True, c.CHECKPOINT_SAVE_FAILED)
    assert message == ("2 consecutive checkpoint save(s) or checks failed, the latest at "
                       f"2026-01-01T00:00:30+00:00: {ERROR}; last committed checkpoint: step 20 "
                       "at 2026-01-01T00:00:00+00:00")


def test_the_condition_follows_the_reports_with_one_event_per_transition() -> None:
    w = running()
    assert c.CHECKPOINTS_FAILING not in conditions(w)  # nothing reported yet

    p = w.reconcile(T0 + timedelta(seconds=1), progress=(report(10, health(0)),))
    assert conditions(w)[c.CHECKPOINTS_FAILING]["status"] == "False"
    assert not [e for e in p.events if c.CHECKPOINTS_FAILING in e.message]  # nothing changed

    p = w.reconcile(T0 + timedelta(seconds=2), progress=(report(12, health(1)),))
    cond = conditions(w)[c.CHECKPOINTS_FAILING]
    assert (cond["status"], cond["reason"]) == ("True", c.CHECKPOINT_SAVE_FAILED)
    assert ERROR in cond["message"] and "step 20" in cond["message"]
    assert w.status["progress"]["checkpointHealth"]["consecutiveFailures"] == 1
    (event,) = [e for e in p.events if e.reason == c.CHECKPOINT_SAVE_FAILED]
    assert event.type == "Warning" and ERROR in event.message

    # Still failing, with a new count and error: the message follows, no second event.
    p = w.reconcile(T0 + timedelta(seconds=3), progress=(report(14, health(2, "other")),))
    assert "2 consecutive" in conditions(w)[c.CHECKPOINTS_FAILING]["message"]
    assert conditions(w)[c.CHECKPOINTS_FAILING]["lastTransitionTime"] == cond[
        "lastTransitionTime"]
    assert not [e for e in p.events if c.CHECKPOINTS_FAILING in e.message]
    p = w.reconcile(T0 + timedelta(seconds=4), progress=())  # nobody answered this round
    assert conditions(w)[c.CHECKPOINTS_FAILING]["status"] == "True" and not p.events

    p = w.reconcile(T0 + timedelta(seconds=5), progress=(report(16, health(0)),))
    assert conditions(w)[c.CHECKPOINTS_FAILING]["reason"] == c.CHECKPOINTS_HEALTHY
    (event,) = [e for e in p.events if c.CHECKPOINTS_FAILING in e.message]
    assert (event.type, event.reason) == ("Normal", c.CHECKPOINTS_HEALTHY)


def test_describe_shows_failing_checkpoints_and_calls_for_attention() -> None:
    w = running()
    w.reconcile(T0 + timedelta(seconds=1), progress=(report(12, health(3)),))
    text = describe_job(w.job, [])
    assert f"Checkpoint saves: FAILING, 3 in a row, the latest at 2026-01-01T00:00:30+00:00: " \
           f"{ERROR}" in text
    assert "Attention:" in text and "CheckpointsFailing=True CheckpointSaveFailed: 3" in text
    w.reconcile(T0 + timedelta(seconds=2), progress=(report(14, {
        "consecutiveFailures": 0, "lastError": ERROR,
        "lastFailureTime": "2026-01-01T00:00:30Z"}),))
    text = describe_job(w.job, [])
    assert "Checkpoint saves: healthy (the last failure at 2026-01-01T00:00:30+00:00" in text
    assert "CheckpointsFailing" not in text
