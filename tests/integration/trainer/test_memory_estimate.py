"""The memory estimate against real trainer runs: two CPU ranks under torchrun, each reporting
its peak resident set (VmHWM) in its step records, within 20% of what `estimate` predicts.

Sized so that what the estimate models dominates the ~0.7 GiB the process itself takes: gpt-100m
(~1.9 GiB of DDP model states and gradient buckets, ~0.8 GiB per FSDP rank), and for activation
checkpointing a small model with large activations (gpt-small, 8192 tokens per micro-batch:
~0.55 GiB of activations without checkpointing, so an estimate that ignored it would be ~45% over).
Two steps each: the first creates the optimizer's state, the second runs the forward with it in
place. Checkpoints are written synchronously, after the last step record.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.estimate import estimate
from elastrain_trainer.events import parse_line

from .conftest import subprocess_env, trainer_env

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(240)]

WORLD = 2
CONFIGS = {
    "ddp": {"model": "gpt-100m", "strategy": "ddp", "seq_len": "64",
            "micro_batch_size": "4", "global_batch_size": "8"},
    "fsdp": {"model": "gpt-100m", "strategy": "fsdp", "seq_len": "64",
             "micro_batch_size": "4", "global_batch_size": "8"},
    "fsdp-activation-checkpointing": {
        "model": "gpt-small", "strategy": "fsdp", "activation_checkpointing": "1",
        "seq_len": "256", "micro_batch_size": "32", "global_batch_size": "64"},
}


@pytest.fixture
def checkpoint_dir() -> Iterator[Path]:
    """gpt-100m checkpoints are 1.2 GB: kept in memory (/dev/shm) where there is one."""
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix="elastrain-mem-", dir=shm if shm.is_dir() else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_torchrun(env: dict[str, str]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={WORLD}", "-m", "elastrain_trainer"],
        # Cold: a warm start's resident set includes the pages it shares with its server.
        env=subprocess_env({**env, "ELASTRAIN_WARM_START": "0"}), capture_output=True,
        text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r for r in map(parse_line, proc.stdout.splitlines()) if r is not None]


@pytest.mark.parametrize("name", CONFIGS)
def test_estimate_is_within_20_percent_of_the_measured_peak(
        name: str, tmp_path: Path, checkpoint_dir: Path) -> None:
    env = trainer_env(tmp_path, steps="2", warmup_steps="1", checkpoint_async="0",
                      checkpoint_uri=f"file://{checkpoint_dir}", **CONFIGS[name])
    steps = [r for r in run_torchrun(env) if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    measured = max(r["peak_memory"] for r in steps)  # rank 0's VmHWM after each step
    predicted = estimate(TrainerConfig.from_env(env), WORLD, "cpu").total_bytes
    print(f"{name}: estimate {predicted / 2**20:.0f} MiB, measured peak "
          f"{measured / 2**20:.0f} MiB ({(predicted - measured) / measured:+.1%})")
    assert abs(predicted - measured) <= 0.2 * measured, (predicted, measured)
