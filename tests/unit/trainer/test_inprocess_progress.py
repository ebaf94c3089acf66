"""/progress under in-process recovery (docs/recovery.md section 10): the operator measures a
loss's recovery up to the first `trainingSince` later than the loss, so each regroup clears it
and the first step completed after it sets it again; `resumedFromStep` is the generation's step,
`worldSize` the new world, and `recoveryMode` / `generation` tell the two modes apart."""

from __future__ import annotations

import pytest

from elastrain_trainer import metrics


@pytest.fixture(autouse=True)
def fresh_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_progress", metrics._Progress())


def test_restart_mode_says_so_and_has_no_generation() -> None:
    metrics.record_start(100, 3, 0)
    metrics.record_step(1, 2.0, 0.1, 0)
    doc = metrics.progress_document()
    assert doc["recoveryMode"] == "Restart" and doc["generation"] is None
    assert doc["trainingSince"] is not None and doc["resumedFromStep"] is None


def test_a_regroup_clears_training_since_until_the_next_step() -> None:
    metrics.record_start(100, 3, 0)
    metrics.record_generation(1, 3, 0, regrouped=False)  # the job's start generation
    for step in range(1, 13):
        metrics.record_step(step, 2.0, 0.1, 0)
    first = metrics.progress_document()
    assert first["generation"] == 1 and first["recoveryMode"] == "InProcess"
    assert first["resumedFromStep"] is None and first["trainingSince"] is not None

    metrics.record_generation(2, 2, 12, regrouped=True)  # a leave at step 12
    regrouped = metrics.progress_document()
    assert regrouped["trainingSince"] is None  # not training again yet
    assert (regrouped["generation"], regrouped["worldSize"], regrouped["resumedFromStep"],
            regrouped["step"]) == (2, 2, 12, 12)

    metrics.record_step(13, 2.0, 0.1, 0)
    after = metrics.progress_document()
    assert after["trainingSince"] is not None and after["trainingSince"] >= first["trainingSince"]
    assert after["trainingSince"] == after["lastStepTime"]


def test_planned_out_pods_are_told_with_their_age_on_this_trainers_clock() -> None:
    """Each plan's lost pods (Plan.lost), aged from when this trainer first saw each: a later
    plan that still names a pod keeps its age; one that no longer names it drops it."""
    metrics.record_start(100, 3, 0)
    assert "plannedOut" not in metrics.progress_document()
    metrics.record_planned_out(["w-2-0"])
    first = metrics._progress.planned_out["w-2-0"]
    metrics._progress.planned_out["w-2-0"] = first - 20.0  # seen 20 s ago
    metrics.record_planned_out(["w-2-0", "w-3-0"])
    told = metrics.progress_document()["plannedOut"]
    assert set(told) == {"w-2-0", "w-3-0"} and told["w-2-0"] >= 20.0 > told["w-3-0"] >= 0.0
    metrics.record_planned_out(["w-3-0"])
    assert set(metrics.progress_document()["plannedOut"]) == {"w-3-0"}
    metrics.record_planned_out([])
    assert "plannedOut" not in metrics.progress_document()


def test_a_lost_pod_that_announced_its_rejoin_is_told_young_again_for_a_while() -> None:
    """A planned-out pod that announced its rejoin (alive, restarting in place) is aged from
    the announcement plus REJOIN_ALLOWANCE_S: the operator's grace starts over, and a later
    plan that still names the pod keeps that age. An announcement for a pod no plan names
    does nothing."""
    metrics.record_start(100, 3, 0)
    metrics.record_planned_out(["w-2-0"])
    metrics._progress.planned_out["w-2-0"] -= 14.0  # out for 14 s: just inside a 15 s grace
    metrics.record_rejoining("w-2-0")
    metrics.record_rejoining("w-9-0")
    assert metrics.progress_document()["plannedOut"] == {"w-2-0": 0.0}
    metrics._progress.planned_out["w-2-0"] -= metrics.REJOIN_ALLOWANCE_S + 5.0
    metrics.record_planned_out(["w-2-0"])
    assert 5.0 <= metrics.progress_document()["plannedOut"]["w-2-0"] < 14.0
    metrics.record_planned_out([])


def test_the_plans_pods_are_told_once_a_plan_named_them() -> None:
    metrics.record_start(100, 3, 0)
    assert "members" not in metrics.progress_document()
    metrics.record_world_pods(["w-0-0", "w-1-0"], ["w-2-0"])
    doc = metrics.progress_document()
    assert (doc["members"], doc["spares"]) == (["w-0-0", "w-1-0"], ["w-2-0"])
