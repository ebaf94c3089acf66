"""A validation split with real torchrun trainers on sharded file:// token files: its loss lands
in the step records, the final /progress document (the termination log) and the run summary, and
a run that validates and is SIGTERMed mid-run ends bit-identical to one that does neither."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.launch.cluster import LocalCluster
from elastrain_trainer.summary import plot_loss, summarize, validation_curve

from .conftest import load_checkpoint, trainer_env
from .test_elastic import RUN_TIMEOUT, STEPS, assert_identical, live_agents, records, run_cluster
from .test_token_datasets import VOCAB, token_bytes

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(300)]
INTERVAL = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shards")
    for i, data in enumerate(token_bytes("llmc", "llama-3", 4)):
        (root / f"train_{i:03d}.bin").write_bytes(data)
    # The validation split: the same kind of tokens in two shards cut elsewhere.
    for i, data in enumerate(token_bytes("llmc", "llama-3", 2)):
        (root / f"val_{i:03d}.bin").write_bytes(data)
    return {"ELASTRAIN_DATASET": f"file://{root}/train_*.bin", "ELASTRAIN_DATASET_FORMAT": "llmc",
            "ELASTRAIN_VOCAB_SIZE": str(VOCAB)}


def test_validation_is_reported_and_changes_no_training(
        shards: dict[str, str], tmp_path: Path) -> None:
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    cluster, codes = run_cluster(ref_dir, {**trainer_env(ref_dir), **shards}, (2, 2), workers=2)
    assert set(codes.values()) == {0}, codes
    reference = load_checkpoint(ref_dir / "ckpt", STEPS, ref_dir)
    assert all("val_loss" not in r for r in records(cluster))

    run_dir = tmp_path / "validated"
    run_dir.mkdir()
    log = run_dir / "termination-log"
    log.touch()  # as Kubernetes makes it: the trainer writes its final progress there
    at = random.randint(INTERVAL // 2, STEPS - 6)

    def preempt(c: LocalCluster) -> None:
        assert c.wait_for_step(at, timeout=RUN_TIMEOUT)
        c.preempt(random.choice(live_agents(c)))
        c.add_agent()

    val = shards["ELASTRAIN_DATASET"].replace("train_*", "val_*")
    env = {**trainer_env(run_dir, step_sleep_seconds="0.15"), **shards,
           "ELASTRAIN_VALIDATION_DATASET": val,
           "ELASTRAIN_VALIDATION_INTERVAL_STEPS": str(INTERVAL),
           "ELASTRAIN_VALIDATION_BATCHES": "3", "ELASTRAIN_TERMINATION_LOG": str(log)}
    cluster, codes = run_cluster(run_dir, env, (2, 2), workers=2, script=preempt)
    recs: list[dict[str, Any]] = records(cluster)
    summary = summarize(recs)
    assert summary.finished and summary.resumes == 1 and summary.steps_lost == 0, codes
    final = load_checkpoint(run_dir / "ckpt", STEPS, run_dir)
    for part in ("model", "optim", "trainer"):
        assert_identical(reference[part], final[part], part)

    curve = validation_curve(recs)
    assert sorted(curve) == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert all(math.isfinite(v) for v in curve.values())
    assert curve[STEPS] < curve[INTERVAL]  # the model learns what the split also holds
    assert (summary.final_validation_loss, summary.validation_step) == (curve[STEPS], STEPS)
    assert json.loads(log.read_text())["validation"] == {"step": STEPS, "loss": curve[STEPS]}
    assert plot_loss(recs, run_dir / "loss.png") is not None
