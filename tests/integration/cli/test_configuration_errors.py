"""`elastrain run --local` fails at once on a configuration error, saying why (issue 18 item 2).

Real torchrun agents under elastrain's launcher, as a worker pod runs them: an llm.c file the
trainer cannot read, a vocabulary too small for the dataset, an invalid trainer setting and a
command that does not exist each fail the run on the first worker's exit (no restart, no
backoff), with the trainer's own message in the CLI's last line; a crash in the training code
still spends its restart budget (the control).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.token_files import llmc_bytes, write

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(400)]
TRAINER = {"model": "gpt-tiny", "steps": 6, "seqLen": 32, "globalBatchSize": 4,
           "microBatchSize": 2}
# A budget that a restart would visibly spend: 3 restarts with 30 s of backoff each.
POLICY = {"maxRestarts": 3, "backoffSeconds": 30}


def run_local(tmp: Path, *, trainer: dict[str, Any] | None = None,
              env: dict[str, str] | None = None, **spec: Any) -> tuple[str, list[str]]:
    job = {"apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "misconfigured"},
           "spec": {"image": "unused", "replicas": 1, "trainer": {**TRAINER, **(trainer or {})},
                    "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                    "restartPolicy": POLICY, **spec}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = subprocess.run(
        [sys.executable, "-m", "elastrain_cli", "run", str(path), "--local", "--fresh",
         "--out", str(tmp / "run")], capture_output=True, text=True, timeout=300, cwd=tmp)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "restart 1/3" not in proc.stdout, out[-3000:]  # no restart, hence no backoff
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return out, lines


def assert_fails_at_once(lines: list[str], *needles: str) -> None:
    last = lines[-1]
    assert last.startswith("elastrain: Failed (ConfigurationError): "), lines[-6:]
    for needle in needles:
        assert needle in last, last


def test_an_unreadable_llmc_file(tmp_path: Path) -> None:
    uri = write(tmp_path / "train.bin", llmc_bytes(np.arange(100), magic=1))
    _, lines = run_local(tmp_path, trainer={"dataset": uri, "datasetFormat": "llmc",
                                            "vocabSize": 512})
    assert_fails_at_once(lines, "train.bin", "bad magic 1 in the llm.c header")


def test_a_vocabulary_too_small(tmp_path: Path) -> None:
    uri = write(tmp_path / "train.bin", llmc_bytes(np.arange(1000)))
    _, lines = run_local(tmp_path, trainer={"dataset": uri, "datasetFormat": "llmc",
                                            "vocabSize": 512})
    assert_fails_at_once(lines, "token id 512 at token 512 is >= vocabSize 512")


def test_an_invalid_trainer_setting(tmp_path: Path) -> None:
    _, lines = run_local(tmp_path, env={"ELASTRAIN_STEPS": "many"})
    assert_fails_at_once(lines, "ELASTRAIN_STEPS='many'")


def test_a_command_that_does_not_exist(tmp_path: Path) -> None:
    _, lines = run_local(tmp_path, command=["torchrun", "tarin.py"])
    assert_fails_at_once(lines, "'tarin.py' does not exist")


def test_a_crash_in_the_training_code_keeps_its_budget(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("raise KeyError('tokens')\n")
    job_policy = {"maxRestarts": 1, "backoffSeconds": 1}
    proc_out, lines = run_crash(tmp_path, job_policy)
    assert "restart 1/1, replacement in 1 s" in proc_out, proc_out[-3000:]
    assert lines[-1].startswith("elastrain: Failed (MaxRestartsExceeded): 2 worker failures"), (
        lines[-6:])


def run_crash(tmp: Path, policy: dict[str, int]) -> tuple[str, list[str]]:
    job = {"apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "crashy"},
           "spec": {"image": "unused", "replicas": 1, "trainer": TRAINER,
                    "command": ["torchrun", "train.py"], "restartPolicy": policy}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = subprocess.run(
        [sys.executable, "-m", "elastrain_cli", "run", str(path), "--local", "--fresh",
         "--out", str(tmp / "run")], capture_output=True, text=True, timeout=300, cwd=tmp)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, [ln for ln in proc.stdout.splitlines() if ln.strip()]
