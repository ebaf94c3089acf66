"""`elastrain run --local` picks the recovery mode the operator would (spec.recovery_mode) and
gives its agents the env the operator renders for a worker pod in that mode; `--recovery`
stands for spec.recovery.mode, with the CRD's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from elastrain_cli.__main__ import _job_source, parse
from elastrain_cli.commands import UserError, local_env, parse_job
from elastrain_operator.model.spec import INPROCESS_COMMAND_MESSAGE
from elastrain_operator.render.env import render_worker_env
from tests.unit.operator.builders import make_job_manifest

# What differs on this machine: its own store (per agent, with the node id), no fixed metrics
# port, checkpoints under an absolute path.
LOCAL_ONLY = {"ELASTRAIN_STORE", "ELASTRAIN_METRICS_PORT", "ELASTRAIN_CHECKPOINT_URI"}


def test_the_default_job_runs_in_process_with_the_pods_env(tmp_path: Path) -> None:
    job = parse_job(*_job_source(None))
    assert job.spec.recovery.mode is None and job.spec.recovery_mode == "InProcess"
    env = local_env(job, job.spec, tmp_path / "out", checkpoint_uri=f"file://{tmp_path}/ckpt",
                    fresh=True)
    pod = {e["name"]: e["value"] for e in render_worker_env(
        job.spec, namespace=job.metadata.namespace, job_uid=env["ELASTRAIN_RUN_ID"],
        job_name=job.metadata.name) if "value" in e}
    assert pod["ELASTRAIN_RECOVERY"] == "inProcess" and pod["PET_STANDALONE"] == "1"
    assert {k: env[k] for k in pod.keys() - LOCAL_ONLY} == {
        k: v for k, v in pod.items() if k not in LOCAL_ONLY}
    assert "ELASTRAIN_NODE_ID" not in env  # one per agent (local.py), as one per pod


def test_recovery_restart_gives_the_restart_env(tmp_path: Path) -> None:
    job = parse_job(*_job_source(None), recovery="Restart")
    assert job.spec.recovery_mode == "Restart"
    env = local_env(job, job.spec, tmp_path / "out", checkpoint_uri=f"file://{tmp_path}/ckpt",
                    fresh=True)
    assert not {k for k in env if k.startswith("PET_")}
    assert "ELASTRAIN_RECOVERY" not in env and "ELASTRAIN_STORE" not in env


def test_recovery_in_process_is_refused_for_a_job_that_cannot_run_it(tmp_path: Path) -> None:
    text = yaml.safe_dump(make_job_manifest("plain", command=["torchrun", "train.py"]))
    assert parse_job(text, "job.yaml").spec.recovery_mode == "Restart"
    with pytest.raises(UserError, match="invalid TrainingJob") as err:
        parse_job(text, "job.yaml", recovery="InProcess")
    assert INPROCESS_COMMAND_MESSAGE in str(err.value)


@pytest.mark.parametrize(("typed", "mode"), [("restart", "Restart"), ("InProcess", "InProcess"),
                                             ("inprocess", "InProcess"), (None, None)])
def test_the_recovery_option_is_spec_recovery_mode(typed: str | None, mode: str | None) -> None:
    argv = ["run", "--local"] + ([] if typed is None else ["--recovery", typed])
    assert parse(argv).recovery == mode


def test_the_recovery_option_refuses_other_modes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["run", "--local", "--recovery", "torchft"])
    assert "'torchft': one of Restart, InProcess" in capsys.readouterr().err
