"""The start-up check of the checkpoint location (checkpoint/precheck.py): what it probes,
when it fails at once, waits or gives up, and that it reports before it leaves."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer import metrics
from elastrain_trainer.checkpoint import precheck as pc
from elastrain_trainer.checkpoint.diagnose import StorageProblem
from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.config import TrainerConfig


def test_probe_passes_on_a_writable_directory_and_leaves_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ckpt")
    assert pc.probe(storage, "host-1") is None
    assert storage.list() == []


def test_probe_names_the_step_that_failed(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    problem = pc.check_location(f"file://{tmp_path}/file/ckpt")
    assert problem is not None and problem.permanent and problem.kind == "no_bucket"
    assert problem.message.startswith("a part of the path is not a directory (NotADirectoryError "
                                      f"ENOTDIR) (on write file://{tmp_path}/file/ckpt/.elastrain-check/")
    bad_endpoint = pc.check_location("s3://b/p", "not a url")
    assert bad_endpoint is not None and bad_endpoint.permanent
    assert bad_endpoint.message.endswith("(on open s3://b/p)")


REFUSED = StorageProblem("credentials", True, "SignatureDoesNotMatch: ... (on write s3://b/p/x)")
DOWN = StorageProblem("unreachable", False, "EndpointConnectionError: ... (on list s3://b/p)")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def run_check(answers: list[StorageProblem | None], wait: int = 600, **kw: Any) -> Clock:
    clock = Clock()
    script = iter(answers)
    cfg = TrainerConfig(checkpoint_uri="s3://b/p", checkpoint_wait_seconds=wait)
    pc.ensure_checkpoint_location(cfg, 0, None, clock=clock, sleep=clock.sleep,
                                  check=lambda uri, endpoint: next(script), **kw)
    return clock


def health() -> dict[str, Any]:
    doc = metrics.progress_document()["checkpointHealth"]
    assert doc is not None
    return dict(doc)


def test_a_refusal_fails_at_once_and_is_reported() -> None:
    metrics.record_checkpoint_healthy()
    with pytest.raises(pc.CheckpointLocationError) as raised:
        run_check([REFUSED], serving=False)
    assert str(raised.value) == ("checkpoint location unusable, training not started: "
                                 + REFUSED.message)
    assert raised.value.__context__ is None and raised.value.__cause__ is None
    assert health()["consecutiveFailures"] == 1 and health()["lastError"] == REFUSED.message
    assert metrics.CONSECUTIVE_FAILURES._value.get() == 1
    assert metrics.CHECKPOINT_FAILURES.labels(kind="credentials")._value.get() >= 1


def test_an_unreachable_store_is_waited_for_with_backoff_then_the_streak_resets() -> None:
    metrics.record_checkpoint_healthy()
    clock = run_check([DOWN, DOWN, DOWN, None], serving=False)
    assert clock.slept == [2.0, 4.0, 8.0]
    assert health()["consecutiveFailures"] == 0
    assert health()["lastError"] == DOWN.message  # kept: the last failure, for humans


def test_an_unreachable_store_fails_once_the_wait_is_over() -> None:
    with pytest.raises(pc.CheckpointLocationError) as raised:
        run_check([DOWN] * 20, wait=60, serving=False)
    assert str(raised.value) == ("checkpoint store still failing after 60 s, training not "
                                 "started: " + DOWN.message)


def test_the_world_agrees_on_the_worst_verdict() -> None:
    assert pc.decide([pc.Verdict(None), pc.Verdict(None)]) == (None, False)
    assert pc.decide([pc.Verdict(DOWN), pc.Verdict(REFUSED)]) == (REFUSED, True)
    assert pc.decide([pc.Verdict(DOWN), pc.Verdict(None)]) == (DOWN, False)
    assert pc.decide([pc.Verdict(DOWN), pc.Verdict(None, out_of_time=True)]) == (DOWN, True)


def test_giving_up_waits_until_the_reason_was_served(monkeypatch: pytest.MonkeyPatch) -> None:
    server = metrics.serve(0, host="127.0.0.1")
    errors: list[BaseException] = []

    def check() -> None:
        try:
            run_check([REFUSED], serving=True)
        except pc.CheckpointLocationError as e:
            errors.append(e)

    thread = threading.Thread(target=check)
    try:
        thread.start()
        thread.join(1.0)
        assert thread.is_alive(), "gave up before anyone read /progress"
        url = f"http://127.0.0.1:{server.server_address[1]}/progress"
        doc = json.loads(urllib.request.urlopen(url, timeout=5).read())
        assert doc["checkpointHealth"]["lastError"] == REFUSED.message
        thread.join(5.0)
        assert not thread.is_alive() and errors
    finally:
        server.shutdown()
    monkeypatch.setattr(pc, "LINGER_SECONDS", 0.1)  # nobody polls: it gives up anyway
    with pytest.raises(pc.CheckpointLocationError):
        run_check([REFUSED], serving=True)


def test_a_read_counts_once_its_reply_is_written_and_only_if_built_after_the_failure() -> None:
    """The trainer exits as soon as the read counts: a reply still being written when it did
    (counted at build, CI saw the operator never get it) or one built before the failure (it
    lacks the reason) must not release it."""
    metrics.record_checkpoint_failed(REFUSED.kind, "before")
    older, _ = metrics._served_progress_document()  # a poll that began before the failure
    metrics.record_checkpoint_failed(REFUSED.kind, REFUSED.message)
    after = metrics.progress_reads()
    metrics._progress_delivered(older)
    assert not metrics.wait_for_progress_read(after, 0.05), "a stale reply released it"
    seq, doc = metrics._served_progress_document()
    assert doc["checkpointHealth"]["lastError"] == REFUSED.message
    assert not metrics.wait_for_progress_read(after, 0.05), "counted before it was written"
    metrics._progress_delivered(seq)
    assert metrics.wait_for_progress_read(after, 0.05)
