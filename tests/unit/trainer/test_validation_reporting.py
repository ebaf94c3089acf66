"""The validation loss as the trainer reports it: when it is evaluated, /progress and the final
progress, Prometheus, the run summary and loss.png (train and validation curves)."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest

from elastrain_trainer import metrics
from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.summary import plot_loss, summarize, validation_curve, write_summary
from elastrain_trainer.train import should_validate


def test_validation_runs_every_interval_and_after_the_last_step() -> None:
    cfg = TrainerConfig(steps=25, validation_dataset="file:///v.bin", validation_interval_steps=10)
    assert [s for s in range(1, 26) if should_validate(s, cfg)] == [10, 20, 25]


def test_progress_and_prometheus_carry_the_latest_validation_loss(tmp_path: Path) -> None:
    metrics.record_validation(20, 2.5)
    metrics.record_validation(30, 2.25)
    assert metrics.progress_document()["validation"] == {"step": 30, "loss": 2.25}
    text = generate_latest(metrics.REGISTRY).decode()
    assert "elastrain_trainer_validation_loss 2.25" in text
    assert "elastrain_trainer_validation_step 30.0" in text
    log = tmp_path / "termination-log"
    log.touch()
    assert metrics.write_final_progress(log)
    assert json.loads(log.read_text())["validation"] == {"step": 30, "loss": 2.25}
    metrics.record_validation(31, float("nan"))  # NaN is not JSON: no validation field
    assert metrics.progress_document()["validation"] is None


def records() -> list[dict[str, object]]:
    recs: list[dict[str, object]] = [
        {"event": "step", "step": s, "loss": 5.0 - s / 10, "world_size": 2, "time": s}
        for s in range(1, 21)]
    for r in recs:
        if r["step"] in (10, 20):
            r["val_loss"] = 5.5 - float(r["step"]) / 20  # type: ignore[arg-type]
    return recs


def test_the_summary_and_the_plot_show_the_validation_curve(tmp_path: Path) -> None:
    recs = records()
    assert validation_curve(recs) == {10: 5.0, 20: 4.5}
    summary = summarize(recs)
    assert (summary.final_validation_loss, summary.validation_step) == (4.5, 20)
    write_summary(summary, {"agent-0": 0}, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["final_validation_loss"] == 4.5
    assert "validation loss: 4.5 (step 20)" in (tmp_path / "summary.txt").read_text()
    import matplotlib.pyplot as plt

    seen: list[list[str]] = []
    real_close = plt.close

    def close(fig: object) -> None:  # the figure's lines before it is closed
        seen.append([line.get_label() for line in fig.axes[0].get_lines()])  # type: ignore[attr-defined]
        real_close(fig)  # type: ignore[arg-type]

    plt.close = close  # type: ignore[assignment]
    try:
        assert plot_loss(recs, tmp_path / "loss.png") == tmp_path / "loss.png"
    finally:
        plt.close = real_close  # type: ignore[assignment]
    assert seen == [["train loss", "validation loss"]]
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_a_run_without_validation_summarizes_as_before() -> None:
    recs = [r for r in records() if "val_loss" not in r]
    assert summarize(recs).final_validation_loss is None
