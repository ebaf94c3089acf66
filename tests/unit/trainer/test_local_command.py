"""How local mode runs a job's own command (spec.command/args) behind local torchrun agents, and
reports a script that prints no elastrain records."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrain_trainer.launch.cluster import TRAINER_ENTRY
from elastrain_trainer.launch.local import LocalRunResult, print_record, worker_entry
from elastrain_trainer.summary import summarize


@pytest.mark.parametrize(("command", "args", "entry"), [
    (["python", "-m", "elastrain_trainer.launch", "-m", "elastrain_trainer"], [],
     TRAINER_ENTRY),
    (["python", "-m", "elastrain_trainer.launch", "-m", "elastrain_trainer"], ["--steps", "5"],
     ("-m", "elastrain_trainer", "--steps", "5")),
    (["torchrun", "train.py"], ["--lr", "1"], ("train.py", "--lr", "1")),
    (["/usr/local/bin/torchrun", "--nproc-per-node=2", "train.py"], [],
     ("--nproc-per-node=2", "train.py")),
    (["python3", "-m", "torch.distributed.run", "/scripts/train.py"], [], ("/scripts/train.py",)),
    (["/opt/venv/bin/python", "-m", "elastrain_trainer.launch", "train.py"], ["x"],
     ("train.py", "x")),
])
def test_worker_entry_keeps_what_follows_the_launcher(
        command: list[str], args: list[str], entry: tuple[str, ...]) -> None:
    assert worker_entry(command, args) == entry


@pytest.mark.parametrize("command", [["python", "train.py"], ["bash", "-c", "torchrun x.py"],
                                     ["python", "-m", "mypackage"], []])
def test_worker_entry_refuses_a_command_that_starts_no_torchrun(command: list[str]) -> None:
    with pytest.raises(ValueError, match="does not start torchrun"):
        worker_entry(command)


def test_a_run_whose_agents_exit_0_succeeded_without_elastrain_records(tmp_path: Path) -> None:
    quiet = summarize([])
    assert LocalRunResult({"agent-0": 0, "agent-1": 0}, quiet, None, tmp_path).ok
    assert not LocalRunResult({"agent-0": 1, "agent-1": 1}, quiet, None, tmp_path).ok
    assert not LocalRunResult({"agent-0": 0, "agent-1": None}, quiet, None, tmp_path).ok


def test_step_records_without_a_loss_print(capsys: pytest.CaptureFixture[str]) -> None:
    print_record("agent-0", {"event": "step", "step": 3, "loss": None, "world_size": 2})
    assert "step     3  loss nan  world 2  0 tok/s" in capsys.readouterr().out
