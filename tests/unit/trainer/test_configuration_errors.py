"""Configuration errors in the trainer and the launcher (issue 18 item 2): a ValueError of
elastrain_trainer's own exits EXIT_CONFIG with one `elastrain: configuration error:` line, the
launcher passes the trainer's message on, and local mode's supervisor fails at once on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.faults import EXIT_CONFIG, guard_main, is_configuration_error
from elastrain_trainer.launch.__main__ import missing_entry
from elastrain_trainer.launch.agent import config_error_of, crash_of
from elastrain_trainer.launch.supervise import config_error


@dataclass
class Failure:
    exitcode: int
    message: Any = ""


def test_the_trainers_value_errors_are_configuration_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def invalid() -> int:
        TrainerConfig.from_env({"ELASTRAIN_STEPS": "many"}, [])
        return 0

    assert guard_main(invalid) == EXIT_CONFIG
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("elastrain: configuration error: ELASTRAIN_STEPS='many'"), line
    assert "ELASTRAIN_STEPS='many'" in error_file.read_text()


def test_a_value_error_from_elsewhere_is_a_crash() -> None:
    def torch_like() -> int:
        return int("not a number")  # raised inside the interpreter, not by elastrain_trainer

    try:
        torch_like()
    except ValueError as e:
        assert not is_configuration_error(e)
    assert guard_main(torch_like) == 1


def test_the_launcher_quotes_the_trainers_message_and_the_supervisor_reads_it() -> None:
    failures = {0: Failure(1, "KeyError: 'x'"),
                1: Failure(EXIT_CONFIG, {"message": "TokenFileError: file:///d.bin: too short",
                                         "extraInfo": {}})}
    line = config_error_of(failures)
    assert line == "elastrain: configuration error: file:///d.bin: too short"
    assert config_error_of({0: Failure(1, "KeyError: 'x'")}) is None
    assert crash_of({0: Failure(EXIT_CONFIG, "")}) is not None  # counted if not read as config
    assert config_error(f"noise\n{line}\nmore\n") == "file:///d.bin: too short"
    assert config_error("elastrain: worker crashed: rank 0, exit code 1") is None


def test_a_command_that_does_not_exist_is_found_before_any_worker_starts(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    assert missing_entry("train.py", cwd=tmp_path) is None
    assert "'tarin.py' does not exist" in str(missing_entry("tarin.py", cwd=tmp_path))
    assert missing_entry("elastrain_trainer", module=True) is None
    assert "does not exist" in str(missing_entry("no_such_pkg.train", module=True))
    assert missing_entry("python3", no_python=True) is None
    assert "not found" in str(missing_entry("no-such-program", no_python=True))
