"""The progress poll against a real HTTP server on 127.0.0.1: what the operator asks for
(in-process jobs: `POST /control` with the job's token and the desired workers, which answers
the progress document; others the plain path), what it does when a trainer refuses the token,
and how it reads the newer `role` field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from elastrain_operator.model.spec import TrainingJobSpec
from elastrain_operator.policy.failures import WorkerPod
from elastrain_operator.policy.progress import parse_progress
from elastrain_operator.probe import fetch_progress, poll_progress, told_replicas
from tests.stand_in_progress import StandInProgress

TOKEN = "the-jobs-token"


@pytest.fixture
def trainer() -> Iterator[StandInProgress]:
    t = StandInProgress({"step": 3, "totalSteps": 10, "role": "spare"}, token=TOKEN)
    yield t
    t.close()


def test_fetch_tells_the_trainer_the_desired_world_with_the_jobs_token(
        trainer: StandInProgress) -> None:
    report = fetch_progress("127.0.0.1", trainer.port, 3, token=TOKEN)
    assert trainer.paths == ["POST /control"] and trainer.told == [3]
    assert report is not None and report.role == "spare" and report.spare
    assert report.progress.step == 3


@pytest.mark.parametrize("token", ["another-operators-token", None], ids=["401", "403"])
def test_a_trainer_that_refuses_the_token_is_read_and_the_operator_says_why(
        token: str | None, caplog: pytest.LogCaptureFixture) -> None:
    trainer = StandInProgress({"step": 3, "totalSteps": 10}, token=token)
    try:
        report = fetch_progress("127.0.0.1", trainer.port, 3, token=TOKEN)
    finally:
        trainer.close()
    assert trainer.paths == ["POST /control", "/progress"] and trainer.told == []
    assert report is not None and report.progress.step == 3
    assert "refused the desired world" in caplog.text


def test_without_replicas_or_token_the_plain_path(trainer: StandInProgress) -> None:
    assert fetch_progress("127.0.0.1", trainer.port) is not None
    assert fetch_progress("127.0.0.1", trainer.port, 3) is not None  # no token: no control
    assert trainer.paths == ["/progress", "/progress"] and trainer.told == []


def test_only_in_process_jobs_tell_the_desired_world() -> None:
    def spec(**fields: object) -> TrainingJobSpec:
        return TrainingJobSpec.model_validate({"image": "i", "replicas": 3, **fields})
    assert told_replicas(spec(recovery={"mode": "InProcess"}, spares=1)) == 3
    assert told_replicas(spec(recovery={"mode": "Restart"})) is None
    assert told_replicas(spec()) == 3  # unset: InProcess for the built-in trainer


def test_poll_asks_every_ready_worker_with_the_jobs_desired_workers(
        trainer: StandInProgress) -> None:
    ready = WorkerPod(name="w-0-0", index=0, attempt=0, phase="Running", ready=True,
                      pod_ip="127.0.0.1")
    starting = WorkerPod(name="w-1-0", index=1, attempt=0, phase="Running", pod_ip="127.0.0.1")
    reports = poll_progress([ready, starting, ready], trainer.port, 5, token=TOKEN)
    assert trainer.paths == ["POST /control"] * 2 and trainer.told == [5, 5]
    assert [r.role for r in reports] == ["spare", "spare"]


@pytest.mark.parametrize(("raw", "role"), [
    ({"role": "member"}, "member"),
    ({"role": "spare"}, "spare"),
    ({}, None),  # restart mode and older trainers leave it out
    ({"role": None}, None),
    ({"role": "leader"}, None),  # unknown: dropped, the report kept
    ({"role": ["spare"]}, None),
])
def test_role_is_parsed_and_a_bad_one_dropped(raw: dict[str, Any], role: str | None) -> None:
    report = parse_progress({"step": 4, **raw})
    assert report is not None and report.progress.step == 4
    assert report.role == role and report.spare == (role == "spare")
