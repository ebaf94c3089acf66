"""bench/goodput.py's pure parts: steps lost and recovery per event, percentiles, goodput."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def goodput() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_goodput", ROOT / "bench" / "goodput.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_goodput"] = module
    spec.loader.exec_module(module)
    return module


def step(n: int, t: float) -> dict[str, Any]:
    return {"event": "step", "step": n, "time": t}


def resumed(n: int, t: float) -> dict[str, Any]:
    return {"event": "resumed", "step": n, "time": t}


def test_a_sigkill_loses_the_steps_since_the_resumed_checkpoint(goodput: ModuleType) -> None:
    records = [step(9, 1.0), step(10, 2.0), step(11, 3.0), step(12, 4.0),
               resumed(10, 9.0), step(11, 9.5), step(12, 10.0)]
    out = goodput.analyse_event(records, 4.2)
    assert (out.resumed_step, out.steps_lost, out.recovery_s) == (10, 2, 5.3)


def test_a_sigterm_save_of_the_last_step_loses_nothing(goodput: ModuleType) -> None:
    # The step after the signal is trained and saved; the resume loads it.
    records = [resumed(13, 12.0), step(12, 5.0), step(13, 6.1), step(14, 12.4)]
    out = goodput.analyse_event(records, 6.0)
    assert (out.steps_lost, out.recovery_s) == (0, 6.4)


def test_an_event_with_no_resume_is_unresolved(goodput: ModuleType) -> None:
    out = goodput.analyse_event([step(1, 1.0), resumed(0, 0.5)], 2.0)
    assert out.steps_lost is None and out.recovery_s is None


def test_percentile_interpolates_and_handles_empty(goodput: ModuleType) -> None:
    assert goodput.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert goodput.percentile([1.0, 2.0], 0.5) == 1.5
    assert goodput.percentile([4.0], 1.0) == 4.0
    assert goodput.percentile([], 0.5) is None


def test_goodput_at_a_period_follows_the_cost_per_event(goodput: ModuleType) -> None:
    assert goodput.goodput_at(300.0, 0.0) == 1.0
    assert goodput.goodput_at(300.0, 9.0) == pytest.approx(300 / 309)
    assert goodput.goodput_at(300.0, -1.0) == 1.0  # noise faster than the baseline


def test_summarize_run_row(goodput: ModuleType) -> None:
    events = [goodput.EventOutcome(1.0, 5, 0, 4.0), goodput.EventOutcome(2.0, 9, 2, 8.0),
              goodput.EventOutcome(3.0, None, None, None)]
    row = goodput.summarize_run("kill", wall_s=130.0, baseline_s=100.0, outcomes=events)
    assert row["goodput"] == pytest.approx(100 / 130, abs=1e-4)
    assert row["cost_per_event_s"] == 10.0
    assert row["goodput_at_300s"] == pytest.approx(300 / 310, abs=1e-4)
    assert row["steps_lost_per_event"] == [0, 2] and row["steps_lost_max"] == 2
    assert row["recovery_p50_s"] == 6.0 and row["recovery_max_s"] == 8.0
    assert row["unresolved_events"] == 1


def test_recovery_phases_split_a_recovery_into_its_milestones(goodput: ModuleType) -> None:
    records = [step(5, 1.0), {"event": "stopping", "step": 6, "time": 2.1},
               {"event": "checkpoint_saved", "step": 6, "time": 2.5},
               {"event": "checkpoint_location_ok", "time": 8.0}, resumed(6, 9.0),
               step(7, 9.5), {"event": "checkpoint_saved", "step": 10, "time": 11.0}]
    assert goodput.recovery_phases(records, 2.0) == {
        "saved": 0.5, "workers_up": 6.0, "resumed": 7.0, "first_step": 7.5}
    # No notice: no stop save.
    assert goodput.recovery_phases(records[3:], 2.0)["saved"] is None


def test_an_inprocess_event_is_answered_by_the_first_leave_or_fail_regroup(
        goodput: ModuleType) -> None:
    def regroup(n: int, t: float, reason: str) -> dict[str, Any]:
        return {"event": "regroup", "step": n, "time": t, "reason": reason}

    records = [step(1, 1.0), step(2, 2.0), regroup(2, 0.5, "start"),
               # killed at 2.5 while step 3 ran: step 3 was trained on a survivor (t 2.9) but the
               # regroup went back to the committed step 2; the replacement's join comes later.
               step(3, 2.9), regroup(2, 4.6, "fail"), step(3, 5.0), step(4, 6.0),
               regroup(4, 6.5, "join"), step(5, 7.0)]
    out = goodput.analyse_inprocess_event(records, 2.5)
    assert (out.resumed_step, out.steps_lost, out.recovery_s) == (2, 1, 2.5)
    # A loss nothing answered yet (only a join after it) is unresolved, not a zero.
    assert goodput.analyse_inprocess_event(records, 6.2).recovery_s is None
    # Too few nodes left: every node saved step 4 and restarted; the start generation answers.
    dissolved = [*records, step(5, 7.2), regroup(4, 9.0, "start"), step(5, 9.5)]
    out = goodput.analyse_inprocess_event(dissolved, 7.1)
    assert (out.resumed_step, out.steps_lost, out.recovery_s) == (4, 1, 2.4)


def test_join_time_is_the_first_step_at_the_full_world_after_the_losss_regroup(
        goodput: ModuleType) -> None:
    def at(n: int, t: float, world: int) -> dict[str, Any]:
        return {**step(n, t), "world_size": world}

    def regroup(t: float, reason: str) -> dict[str, Any]:
        return {"event": "regroup", "step": 2, "time": t, "reason": reason}

    # No spare: the loss at 2.5 leaves world 2; the replacement joins at 9.0 (world 3 again).
    no_spare = [at(1, 1.0, 3), at(2, 2.0, 3), regroup(4.0, "fail"), at(3, 4.2, 2),
                regroup(9.0, "join"), at(4, 9.3, 3)]
    assert goodput.full_world_after(no_spare, 2.5, 3) == 6.8
    # A spare: the loss's own regroup keeps world 3.
    spare = [at(1, 1.0, 3), at(2, 2.0, 3), regroup(3.6, "fail"), at(3, 3.9, 3)]
    assert goodput.full_world_after(spare, 2.5, 3) == 1.4
    assert goodput.full_world_after(no_spare[:4], 2.5, 3) is None  # never back: unresolved


def test_the_victim_is_never_a_waiting_spare(goodput: ModuleType) -> None:
    records = [("agent-2", {"event": "spare"}), ("agent-0", {"event": "regroup"}),
               ("agent-3", {"event": "spare"}), ("agent-2", {"event": "regroup"})]
    assert goodput.waiting_spares(records) == {"agent-3"}  # agent-2 was taken in since
