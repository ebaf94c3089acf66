"""The `elastrain` command: offline validation names the field; the embedded job is valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from elastrain_cli.__main__ import main
from tests.unit.operator.builders import make_job_manifest


def write(tmp_path: Path, manifest: object) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


def test_validate_accepts_a_valid_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", write(tmp_path, make_job_manifest("ok"))]) == 0
    assert "TrainingJob ok is valid" in capsys.readouterr().out


def test_validate_warns_about_settings_the_device_cannot_honour(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = make_job_manifest("gpu", nprocPerNode=8, resources={"limits": {"nvidia.com/gpu": 4}})
    assert main(["validate", write(tmp_path, job)]) == 0  # a warning, not a refusal
    out = capsys.readouterr()
    assert "TrainingJob gpu is valid" in out.out
    assert "warning: spec.nprocPerNode 8 is more than the pod's 4 GPU(s)" in out.err


def test_validate_refuses_a_loosening_naming_the_level(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = make_job_manifest("loose", template={"podSecurityContext": {"runAsUser": 0}})
    assert main(["validate", write(tmp_path, job)]) == 2
    assert "set spec.template.podSecurity: Baseline to allow it" in capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"replicas": 9}, "spec: spec.replicas must be <= spec.maxReplicas"),
    ({"trainer": {"lr": -1}}, "spec.trainer.lr: Input should be greater than 0"),
    ({"env": [{"value": "x"}]}, "spec.env[0].name: Field required"),
    ({"checkpoint": {"uri": "ftp://bucket/p"}}, "spec.checkpoint.uri must be s3://"),
    ({"checkpoint": {"uri": "gs://Bucket/p"}}, "gs://<bucket>[/<prefix>] (the image needs gcsfs)"),
])
def test_validate_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  overrides: dict[str, object], expected: str) -> None:
    assert main(["validate", write(tmp_path, make_job_manifest("bad", **overrides))]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("uri", ["gs://my_bucket/run", "az://ckpts/run",
                                 "abfs://ckpts@acct.dfs.core.windows.net/run"])
def test_validate_accepts_the_object_store_schemes_of_the_image(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], uri: str) -> None:
    path = write(tmp_path, make_job_manifest("ok", checkpoint={"uri": uri}))
    assert main(["validate", path]) == 0
    assert "is valid" in capsys.readouterr().out


def test_validate_applies_the_crds_rules_on_the_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from elastrain_operator.model.spec import NAME_DNS_LABEL_MESSAGE, NAME_LENGTH_MESSAGE

    path = write(tmp_path, make_job_manifest("9" + "x" * 60))
    assert main(["validate", path]) == 2
    assert capsys.readouterr().err == (f"elastrain: {path}: invalid TrainingJob:\n"
                                       f"  {NAME_LENGTH_MESSAGE}\n  {NAME_DNS_LABEL_MESSAGE}\n")


def test_validate_refuses_other_kinds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", write(tmp_path, {"kind": "Pod"})]) == 2
    assert "expected exactly one manifest of kind TrainingJob, found 0" in capsys.readouterr().err


def test_embedded_default_job_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    from elastrain_cli.__main__ import _job_source
    from elastrain_cli.commands import parse_job

    job = parse_job(*_job_source(None))
    assert job.metadata.name == "demo" and job.spec.replicas == 2
    assert job.spec.checkpoint is not None and job.spec.checkpoint.uri.startswith("file://")


def test_crds_prints_the_generated_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds"]) == 0
    from elastrain_operator.render.crd import render_crd_yaml

    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["metadata"]["name"] == "trainingjobs.elastrain.dev"
    assert printed == render_crd_yaml()
