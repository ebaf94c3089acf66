"""/progress "validation" -> status.progress.validation: parsed, merged, kept across restarts."""

from __future__ import annotations

from elastrain_operator.model.status import Progress, ValidationLoss
from elastrain_operator.policy.progress import merge_progress, parse_progress


def report(step: int, validation: object = None) -> object:
    doc = {"step": step, "totalSteps": 100, "loss": 2.0, "worldSize": 2}
    if validation is not None:
        doc["validation"] = validation
    return parse_progress(doc)


def test_the_validation_loss_is_parsed_into_progress() -> None:
    r = parse_progress({"step": 40, "validation": {"step": 40, "loss": 3.25}})
    assert r is not None and r.progress.validation == ValidationLoss(step=40, loss=3.25)
    # Older trainers send none; a malformed one is dropped, the report kept.
    for raw in (None, {"loss": 1.0}, "3.0"):
        r = parse_progress({"step": 40, "validation": raw})
        assert r is not None and r.progress.validation is None


def test_status_keeps_the_newest_validation_loss_across_a_restart() -> None:
    first, _ = merge_progress(None, None, [report(40, {"step": 40, "loss": 3.0}),
                                           report(41, None)])  # type: ignore[list-item]
    assert first is not None and first.step == 41
    assert first.validation == ValidationLoss(step=40, loss=3.0)
    # A restarted trainer has not evaluated yet: the status keeps the last one.
    again, _ = merge_progress(first, None, [report(45)])  # type: ignore[list-item]
    assert again is not None and again.validation == ValidationLoss(step=40, loss=3.0)
    newer, _ = merge_progress(again, None, [report(50, {"step": 50, "loss": 2.5})])  # type: ignore[list-item]
    assert newer is not None and newer.validation == ValidationLoss(step=50, loss=2.5)
    assert Progress.model_validate(newer.model_dump(by_alias=True)).validation == newer.validation
