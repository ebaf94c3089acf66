from __future__ import annotations

import math

import pytest

from elastrain_trainer.api import should_checkpoint
from elastrain_trainer.guard import SpikeGuard
from elastrain_trainer.schedule import Schedule, lr_at

COS = Schedule("cosine", lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
WSD = Schedule("wsd", lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110, decay_fraction=0.2)


def test_warmup_is_linear_to_peak() -> None:
    assert [lr_at(COS, s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_decays_to_min_lr_at_the_end() -> None:
    assert lr_at(COS, 10) == pytest.approx(1.0)
    assert lr_at(COS, 60) == pytest.approx(0.55)
    assert lr_at(COS, 110) == pytest.approx(0.1)
    assert lr_at(COS, 500) == pytest.approx(0.1)


def test_wsd_holds_then_decays_linearly_over_the_last_fraction() -> None:
    assert lr_at(WSD, 50) == 1.0 and lr_at(WSD, 87) == 1.0
    assert lr_at(WSD, 99) == pytest.approx(0.55)
    assert lr_at(WSD, 110) == pytest.approx(0.1)


def test_guard_off_applies_everything() -> None:
    assert SpikeGuard(0).should_skip(math.nan, 1e9) is None


def test_guard_skips_non_finite_and_spikes_after_history() -> None:
    g = SpikeGuard(3.0)
    assert g.should_skip(math.inf, 1.0) is not None
    for _ in range(5):
        assert g.should_skip(2.0, 1.0) is None
        g.observe(2.0, 1.0, skipped=False)
    assert g.should_skip(2.5, 1.0) is None
    assert "grad norm" in (g.should_skip(2.0, 10.0) or "")
    assert "loss" in (g.should_skip(7.0, 1.0) or "")
    g.observe(7.0, 1.0, skipped=True)
    assert (g.skipped_steps, g.loss_mean) == (1, 2.0)


def test_guard_state_round_trips() -> None:
    g = SpikeGuard(2.0)
    g.observe(3.0, 0.5, skipped=False)
    h = SpikeGuard(2.0)
    h.load_state_dict(g.state_dict())
    assert h == g


def test_checkpoint_policy() -> None:
    assert should_checkpoint(10, 5, time_due=False)
    assert not should_checkpoint(11, 5, time_due=False)
    assert not should_checkpoint(10, 0, time_due=False)
    assert should_checkpoint(11, 0, time_due=True)
