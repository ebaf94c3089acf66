"""Fault injection is armed only by a file that a harness writes (fault_injection's docstring):
the knobs as environment variables, as a job's spec.env would pass them, do nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrain_trainer import fault_injection
from elastrain_trainer.fault_injection import FILE_VARIABLE, InjectedCrash, after_step


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    fault_injection._read.cache_clear()
    fault_injection._ignored_told = False
    yield
    fault_injection._read.cache_clear()


def armed(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "faults.env"
    path.write_text(text)
    return {FILE_VARIABLE: str(path)}


def test_the_knobs_in_the_environment_alone_do_nothing_and_are_told_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    env = {"ELASTRAIN_FAULT_CRASH_AT_STEP": "3", "ELASTRAIN_FAULT_HANG_AT_STEP": "4"}
    for step in range(1, 6):
        after_step(step, 0, fresh=True, env=env)
    out = capsys.readouterr().out
    assert out.count("elastrain: ignoring ELASTRAIN_FAULT_CRASH_AT_STEP, "
                     "ELASTRAIN_FAULT_HANG_AT_STEP: fault injection is read only from the file "
                     f"{FILE_VARIABLE} names") == 1, out


def test_a_crash_armed_by_the_file_fires_at_its_step_on_its_rank(tmp_path: Path) -> None:
    env = armed(tmp_path, "# a comment\n\nELASTRAIN_FAULT_CRASH_AT_STEP=3\n"
                          "ELASTRAIN_FAULT_CRASH_RANK = 1\n")
    after_step(2, 1, fresh=True, env=env)
    after_step(3, 0, fresh=True, env=env)  # another rank
    with pytest.raises(InjectedCrash, match=r"injected crash at step 3 on rank 1 "
                                            r"\(ELASTRAIN_FAULT_CRASH_AT_STEP\)"):
        after_step(3, 1, fresh=False, env=env)


def test_crash_once_fires_once(tmp_path: Path) -> None:
    env = armed(tmp_path, f"ELASTRAIN_FAULT_CRASH_AT_STEP=2\n"
                          f"ELASTRAIN_FAULT_CRASH_ONCE={tmp_path / 'crashed'}\n")
    with pytest.raises(InjectedCrash):
        after_step(2, 0, fresh=True, env=env)
    after_step(2, 0, fresh=True, env=env)  # resumed and trained step 2 again: no crash
    assert (tmp_path / "crashed").exists()


@pytest.mark.parametrize(("text", "message"), [
    ("ELASTRAIN_FAULT_CRASH_AT_STEPS=3\n", "is not KEY=VALUE with KEY one of"),
    ("crash\n", "is not KEY=VALUE"),
    ("ELASTRAIN_FAULT_HANG_AT_STEP=soon\n", "must be a whole number, not 'soon'"),
])
def test_a_fault_file_that_says_nothing_clear_is_refused(tmp_path: Path, text: str,
                                                         message: str) -> None:
    env = armed(tmp_path, text)
    with pytest.raises(ValueError, match=message):
        after_step(1, 0, fresh=True, env=env)


def test_a_named_fault_file_that_is_missing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the fault file"):
        after_step(1, 0, fresh=True, env={FILE_VARIABLE: str(tmp_path / "absent")})
