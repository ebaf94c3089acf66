"""Telling a worker's own crash from a lost peer (faults.py) and the launcher's verdict."""

from __future__ import annotations

import signal
from dataclasses import dataclass

import pytest

from elastrain_trainer.faults import crash_reason, guard_main, is_crash, peer_lost
from elastrain_trainer.launch.agent import crash_of
from elastrain_trainer.launch.supervise import RestartBudget, crash_line
from elastrain_trainer.signals import EXIT_RESTART

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
              "[127.0.0.1]:53172: Connection reset by peer. This is typically caused by a remote "
              "worker hanging or bugs in the application.")


@dataclass
class Failure:  # the slice of torchelastic's ProcessFailure the launcher reads
    exitcode: int
    message: object = ""


@pytest.mark.parametrize(("exitcode", "message", "crash"), [
    (0, "", False),
    (EXIT_RESTART, "", False),
    (-signal.SIGTERM, "", False),
    (-signal.SIGINT, "", False),
    (-signal.SIGKILL, "", True),  # the OOM killer: the job's own making
    (-signal.SIGSEGV, "", True),
    (1, "", True),
    (2, "ValueError: spec.trainer.steps must be >= 1", True),
    (1, f"RuntimeError: {GLOO_RESET}", False),
    (1, "torch.distributed.DistNetworkError: Broken pipe", False),
])
def test_is_crash(exitcode: int, message: str, crash: bool) -> None:
    assert is_crash(exitcode, message) is crash


def test_peer_lost_follows_the_cause_chain() -> None:
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as inner:
            raise ValueError("optimizer step failed") from inner
    except ValueError as outer:
        assert peer_lost(outer)
    assert not peer_lost(ZeroDivisionError("division by zero"))


def test_guard_main_turns_a_lost_peer_into_a_restart_and_records_a_crash(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def lost() -> int:
        raise RuntimeError(GLOO_RESET)

    def crash() -> int:
        raise KeyError("tokens")

    assert guard_main(lost) == EXIT_RESTART
    assert not error_file.exists()
    assert guard_main(crash) == 1
    assert "KeyError: 'tokens'" in error_file.read_text()
    assert guard_main(lambda: 0) == 0


def test_the_launcher_quotes_the_first_crashed_rank() -> None:
    failures = {0: Failure(EXIT_RESTART), 3: Failure(1, {"message": "AssertionError: nan loss",
                                                         "extraInfo": {}}),
                5: Failure(1, "To enable traceback see: https://pytorch.org/docs/...")}
    reason = crash_of(failures)
    assert reason == "elastrain: worker crashed: rank 3, exit code 1: AssertionError: nan loss"
    assert crash_of({0: Failure(EXIT_RESTART), 1: Failure(-signal.SIGTERM)}) is None
    assert crash_of({2: Failure(1, "To enable traceback see: x")}) == (
        "elastrain: worker crashed: rank 2, exit code 1")
    assert crash_reason(-9, "", 0) == (
        "elastrain: worker crashed: rank 0, killed by SIGKILL (out of memory?)")
    assert crash_line(f"noise\n{reason}\nTraceback...\n") == reason


def test_local_backoff_doubles_and_is_capped() -> None:
    budget = RestartBudget(max_restarts=5, backoff_seconds=10, max_backoff_seconds=25)
    assert [budget.backoff(n) for n in range(4)] == [0, 10, 20, 25]
    assert RestartBudget(backoff_seconds=0).backoff(3) == 0
