from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from elastrain_trainer import metrics
from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.estimate import (
    GIB,
    check_fits,
    estimate,
    measure_peak,
    return_freed_host_memory,
)
from elastrain_trainer.summary import summarize, write_summary


def test_fsdp_shards_model_states_and_ddp_does_not() -> None:
    ddp = estimate(TrainerConfig(model="gpt-1b", strategy="ddp"), 8)
    fsdp = estimate(TrainerConfig(model="gpt-1b", strategy="fsdp"), 8)
    assert ddp.params_bytes == 4 * ddp.n_params
    assert ddp.optimizer_bytes == 8 * ddp.n_params
    assert fsdp.params_bytes == ddp.params_bytes // 8
    assert fsdp.activations_bytes == ddp.activations_bytes
    assert "gpt-1b" in fsdp.format() and "total" in fsdp.format()


def test_hsdp_shards_over_a_pods_ranks_only() -> None:
    ddp = estimate(TrainerConfig(model="gpt-1b", strategy="ddp"), 16)
    hsdp = estimate(TrainerConfig(model="gpt-1b", strategy="hsdp"), 16, ranks_per_node=8)
    assert hsdp.params_bytes == ddp.params_bytes // 8  # 2 pods x 8: 8 shards, 2 replicas
    assert hsdp.optimizer_bytes == ddp.optimizer_bytes // 8


def test_ddp_counts_its_gradient_buckets_and_fsdp_its_unsharded_blocks() -> None:
    ddp = estimate(TrainerConfig(model="gpt-100m", strategy="ddp"), 2)
    fsdp = estimate(TrainerConfig(model="gpt-100m", strategy="fsdp"), 2)
    assert ddp.buffers_bytes == 4 * ddp.n_params  # a flat copy of every gradient
    # Two blocks of 12 d^2 + 13 d fp32 params, plus the root's embeddings and head.
    assert 2 * 4 * (12 * 768**2) < fsdp.buffers_bytes < 3 * 4 * (12 * 768**2)


def test_gradients_and_activations_do_not_peak_together() -> None:
    states_bound = TrainerConfig(model="gpt-100m", micro_batch_size=1, seq_len=64)
    est = estimate(states_bound, 1)
    assert est.grads_bytes > est.activations_bytes
    assert est.total_bytes == (est.params_bytes + est.optimizer_bytes + est.buffers_bytes
                               + est.grads_bytes + est.overhead_bytes)
    acts_bound = estimate(TrainerConfig(model="gpt-tiny", micro_batch_size=64,
                                       global_batch_size=64), 1)
    assert acts_bound.activations_bytes > acts_bound.grads_bytes
    assert acts_bound.total_bytes - acts_bound.overhead_bytes == (
        acts_bound.params_bytes + acts_bound.optimizer_bytes + acts_bound.buffers_bytes
        + acts_bound.activations_bytes)
    assert "(not at the peak)" in est.format()


def test_the_runtime_overhead_depends_on_the_device() -> None:
    cfg = TrainerConfig()
    assert estimate(cfg, 1, "cpu").overhead_bytes == 3 * GIB // 4  # measured: see estimate.py
    assert estimate(cfg, 1, "cuda").overhead_bytes == GIB // 2
    with pytest.raises(ValueError, match="device"):
        estimate(cfg, 1, "tpu")


def test_cpu_offload_moves_model_states_off_a_gpu_only() -> None:
    cfg = TrainerConfig(model="gpt-350m", strategy="fsdp", cpu_offload=True)
    gpu, cpu = estimate(cfg, 4, "cuda"), estimate(cfg, 4, "cpu")
    assert gpu.params_bytes == gpu.optimizer_bytes == 0 and gpu.offloaded_bytes > 0
    assert cpu.offloaded_bytes == 0 and cpu.params_bytes > 0  # wrap_model offloads only on CUDA


def test_the_host_peak_is_vmhwm_of_this_process(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t 9999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n")
    assert measure_peak("cpu", str(status)) == (2 << 20, "host_rss")
    bytes_, measure = measure_peak("cpu")  # this test process, really
    assert measure == "host_rss" and bytes_ > 10 << 20


def test_a_chosen_malloc_mmap_threshold_is_kept() -> None:
    assert return_freed_host_memory({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False


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
    assert s.peak_memory_bytes is None  # records from before the trainer measured it


def test_summary_reports_the_largest_peak_memory_of_the_run(tmp_path: Path) -> None:
    recs = [{"event": "step", "step": s, "loss": 1.0, "world_size": 1, "time": s,
             "peak_memory": peak} for s, peak in ((1, 3 * GIB), (2, 5 * GIB), (3, 4 * GIB))]
    summary = summarize(recs)
    assert summary.peak_memory_bytes == 5 * GIB
    write_summary(summary, {"agent-0": 0}, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["peak_memory_bytes"] == 5 * GIB
    assert "peak memory (rank 0): 5.00 GiB" in (tmp_path / "summary.txt").read_text()


def test_progress_document_has_the_operator_fields() -> None:
    metrics.record_start(total_steps=50, world_size=2, restarts=0)
    metrics.record_step(step=3, loss=float("nan"), duration_s=0.1, tokens=10)
    metrics.record_committed(2, "s3://b/p/step-00000002", "2024-01-01T00:00:00Z")
    doc = metrics.progress_document()
    training_since = doc.pop("trainingSince")
    started_at, last_step = doc.pop("startedAt"), doc.pop("lastStepTime")
    doc.pop("checkpointHealth")  # set by the checkpoint tests; see test_checkpoint_*.py
    doc.pop("memory")  # see test_progress_document_reports_peak_memory_beside_the_estimate
    doc.pop("validation")  # see test_validation_reporting.py
    assert started_at <= last_step == training_since
    assert doc == {"step": 3, "totalSteps": 50, "loss": None, "worldSize": 2,
                   "lastCheckpoint": {"step": 2, "uri": "s3://b/p/step-00000002",
                                      "time": "2024-01-01T00:00:00Z"},
                   "resumedFromStep": None, "checkpointFallback": None,
                   "recoveryMode": "Restart", "generation": None}
    assert training_since.endswith("Z")
    # 2024-01-01T00:00:00Z: the dashboard's checkpoint age is time() minus this gauge.
    assert metrics.LAST_CHECKPOINT_TIME._value.get() == 1704067200.0


def test_progress_document_reports_peak_memory_beside_the_estimate() -> None:
    metrics.record_memory_estimate(3 * GIB)
    metrics.record_peak_memory(2 * GIB, "host_rss")
    assert metrics.progress_document()["memory"] == {
        "peakBytes": 2 * GIB, "measure": "host_rss", "estimateBytes": 3 * GIB}
    assert metrics.PEAK_MEMORY._value.get() == 2 * GIB


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
                            "checkpointHealth", "checkpointFallback", "validation", "memory",
                            "recoveryMode", "generation"}
    finally:
        server.shutdown()


def test_a_fallback_is_in_progress_until_the_next_start() -> None:
    metrics.record_start(total_steps=50, world_size=2, restarts=0)
    metrics.record_checkpoint_fallback(
        skipped_step=12, skipped_uri="s3://b/p/step-00000012", reason="x" * 700, loaded_step=8,
        loaded_uri="s3://b/p/step-00000008", steps_lost=4, quarantined=True)
    doc = metrics.progress_document()["checkpointFallback"]
    assert doc.pop("time")
    assert doc == {"skippedStep": 12, "skippedUri": "s3://b/p/step-00000012",
                   "reason": "x" * 600, "loadedStep": 8, "loadedUri": "s3://b/p/step-00000008",
                   "stepsLost": 4, "quarantined": True}
    metrics.record_start(total_steps=50, world_size=2, restarts=1)
    assert metrics.progress_document()["checkpointFallback"] is None


def test_summary_counts_the_steps_a_fallback_lost() -> None:
    def rec(event: str, t: float, **fields: object) -> dict[str, object]:
        return {"event": event, "time": t, **fields}

    steps = [rec("step", i, step=i, loss=1.0, world_size=2) for i in range(1, 5)]
    # A new run: checkpoint 12 was damaged, it resumed from 8 (no step records above 8 here).
    resumed = [rec("resumed", 10, step=8, skipped_step=12, steps_lost=4),
               *(rec("step", 10 + i, step=8 + i, loss=1.0, world_size=2) for i in range(1, 3))]
    assert summarize(resumed).steps_lost == 4
    # Nothing usable: started from 0, the 12 steps behind the damaged checkpoint are lost.
    assert summarize([rec("fresh_start", 0, skipped_step=12, steps_lost=12),
                      *steps]).steps_lost == 12
    assert summarize([rec("fresh_start", 0, skipped_step=12, steps_lost=12)]).resumes == 0
