"""`elastrain estimate JOB --device-memory SIZE`: does the job fit a device, and what fixes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from elastrain_cli.__main__ import main
from tests.unit.operator.builders import make_job_manifest

GPU = {"limits": {"nvidia.com/gpu": 1}}
# gpt-1b under DDP on 8 GPUs: ~23 GiB per rank (18 GiB of model states + 4.5 GiB of buckets).
BIG = {"replicas": 8, "maxReplicas": 8, "strategy": "ddp", "resources": GPU,
       "trainer": {"model": "gpt-1b", "precision": "bf16", "seqLen": 256,
                   "microBatchSize": 2, "globalBatchSize": 64}}


def write(tmp_path: Path, manifest: object) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


def test_a_job_that_fits_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", write(tmp_path, make_job_manifest("big", **BIG)),
                 "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "DDP x 8 rank(s), bf16 on cuda" in out
    assert "fits: 23." in out and "of 80.00 GiB per rank" in out


def test_a_job_that_does_not_fit_names_the_knobs_and_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", write(tmp_path, make_job_manifest("big", **BIG)),
                 "--device-memory", "16Gi"]) == 1
    out = capsys.readouterr().out
    assert "does not fit: 23." in out and "of 16.00 GiB per rank; it fits with:" in out
    assert "  spec.strategy: fsdp -> " in out
    assert "spec.trainer.cpuOffload: true" in out


def test_a_cpu_job_is_estimated_for_the_host(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", write(tmp_path, make_job_manifest("cpu")),
                 "--device-memory", "512MiB"]) == 1
    out = capsys.readouterr().out
    assert "on cpu" in out and "runtime overhead   0.75 GiB" in out
    assert "no knob tried" in out


def test_a_bad_size_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", write(tmp_path, make_job_manifest("x")),
                 "--device-memory", "lots"]) == 2
    assert "'lots' is not a memory size" in capsys.readouterr().err
