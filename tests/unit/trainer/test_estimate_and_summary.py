from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from elastrain_trainer import metrics
from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.estimate import GIB, check_fits, estimate
from elastrain_trainer.summary import summarize


def test_fsdp_shards_model_states_and_ddp_does_not() -> None:
    ddp = estimate(TrainerConfig(model="gpt-1b", strategy="ddp"), 8)
    fsdp = estimate(TrainerConfig(model="gpt-1b", strategy="fsdp"), 8)
    assert ddp.params_bytes == 4 * ddp.n_params
    assert ddp.optimizer_bytes == 8 * ddp.n_params
    assert fsdp.params_bytes == ddp.params_bytes // 8
    assert fsdp.activations_bytes == ddp.activations_bytes
    assert "gpt-1b" in fsdp.format() and "total" in fsdp.format()


def test_checkpointing_and_half_precision_shrink_activations() -> None:
    base = estimate(TrainerConfig(model="gpt-350m"), 1).activations_bytes
    assert estimate(TrainerConfig(model="gpt-350m", precision="bf16"), 1).activations_bytes < base
    ckpt = TrainerConfig(model="gpt-350m", activation_checkpointing=True)
    assert estimate(ckpt, 1).activations_bytes < base / 4


def test_a_config_that_cannot_fit_is_refused_with_the_estimate() -> None:
    est = estimate(TrainerConfig(model="gpt-1b"), 1)
    with pytest.raises(ValueError, match="ELASTRAIN_MODEL"):
        check_fits(est, 4 * GIB, "a test host")
    check_fits(estimate(TrainerConfig(), 1), 4 * GIB, "a test host")


def test_summary_counts_steps_lost_per_resume() -> None:
    recs = [{"event": "step", "step": s, "loss": 1.0, "world_size": 2, "time": s}
            for s in range(1, 11)]
    recs += [{"event": "resumed", "step": 8, "world_size": 1, "time": 10.5},
             {"event": "step", "step": 9, "loss": 0.9, "world_size": 1, "time": 11},
             {"event": "finished", "time": 12}]
    s = summarize(recs)
    assert (s.finished, s.resumes, s.steps_lost, s.world_sizes) == (True, 1, 2, [2, 1])


def test_progress_document_has_the_operator_fields() -> None:
    metrics.record_start(total_steps=50, world_size=2, restarts=0)
    metrics.record_step(step=3, loss=float("nan"), duration_s=0.1, tokens=10)
    metrics.record_committed(2, "s3://b/p/step-00000002", "2024-01-01T00:00:00Z")
    doc = metrics.progress_document()
    training_since = doc.pop("trainingSince")
    started_at, last_step = doc.pop("startedAt"), doc.pop("lastStepTime")
    doc.pop("checkpointHealth")  # set by the checkpoint tests; see test_checkpoint_*.py
    assert started_at <= last_step == training_since
    assert doc == {"step": 3, "totalSteps": 50, "loss": None, "worldSize": 2,
                   "lastCheckpoint": {"step": 2, "uri": "s3://b/p/step-00000002",
                                      "time": "2024-01-01T00:00:00Z"},
                   "resumedFromStep": None}
    assert training_since.endswith("Z")
    # 2024-01-01T00:00:00Z: the dashboard's checkpoint age is time() minus this gauge.
    assert metrics.LAST_CHECKPOINT_TIME._value.get() == 1704067200.0


def test_progress_document_says_when_training_resumed_once_per_start() -> None:
    metrics.record_start(total_steps=50, world_size=2, restarts=1)
    metrics.record_resumed(20)
    doc = metrics.progress_document()
    assert (doc["step"], doc["resumedFromStep"], doc["trainingSince"]) == (20, 20, None)
    before = datetime.now(UTC) - timedelta(seconds=1)
    metrics.record_step(step=21, loss=1.0, duration_s=0.1, tokens=10)
    first = metrics.progress_document()["trainingSince"]
    assert before <= datetime.fromisoformat(first) <= datetime.now(UTC)
    time.sleep(0.01)  # a later step would carry a later time
    metrics.record_step(step=22, loss=1.0, duration_s=0.1, tokens=10)
    assert metrics.progress_document()["trainingSince"] == first  # the first step only
    metrics.record_start(total_steps=50, world_size=1, restarts=2)  # the next (re)start
    assert metrics.progress_document()["resumedFromStep"] is None
    assert metrics.progress_document()["trainingSince"] is None


def test_final_progress_goes_to_the_termination_log_only_where_kubernetes_made_one(
        tmp_path: Path) -> None:
    metrics.record_start(total_steps=5, world_size=1, restarts=0)
    metrics.record_step(step=5, loss=1.0, duration_s=0.1, tokens=10)
    metrics.record_committed(5, "s3://b/p/step-00000005", "2024-01-01T00:00:00Z")
    absent = tmp_path / "termination-log"
    assert not metrics.write_final_progress(absent)
    assert not absent.exists()  # never created outside a container
    absent.touch()  # the kubelet creates it
    assert metrics.write_final_progress(absent)
    doc = json.loads(absent.read_text())
    assert (doc["step"], doc["lastCheckpoint"]["step"]) == (5, 5)


def test_metrics_server_serves_prometheus_and_progress() -> None:
    import json
    import urllib.request

    server = metrics.serve(0, host="127.0.0.1")
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        assert "elastrain_trainer_steps_total" in text
        assert "elastrain_trainer_checkpoint_save_duration_seconds_bucket" in text
        doc = json.loads(urllib.request.urlopen(base + "/progress", timeout=5).read())
        assert set(doc) == {"step", "totalSteps", "loss", "worldSize", "lastCheckpoint",
                            "resumedFromStep", "trainingSince", "startedAt", "lastStepTime",
                            "checkpointHealth"}
    finally:
        server.shutdown()
