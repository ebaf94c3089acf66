"""A notice (SIGTERM) to a launcher whose trainer reads through a DataLoader with worker
processes (launch/agent.py, patch_notice_to_trainer): the launcher signals the trainer process
only, so the loader's workers keep serving batches and the trainer stops at a step boundary as
without them; the trainer's process group is killed only at the deadline (--shutdown-timeout),
or once the trainer is gone, so no loader worker outlives it.

- restart mode, two local agents (`elastrain run --local`'s LocalCluster): the signalled worker
  saves its step, the survivor resumes from it and finishes;
- in-process mode, two pods (test_inprocess_launcher's Pods): the signalled node leaves at a
  step boundary, the survivor regroups (a leave, not a failure) in the same process;
- torch's own worker context (SubprocessContext.close): a trainer that ignores the notice is
  killed with its group at the deadline; a trainer that stops leaves no child behind.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler,
)

from elastrain_trainer.launch import agent as launch_agent
from elastrain_trainer.launch.cluster import LocalCluster

from .conftest import preempt_second_agent_at
from .test_inprocess import wait_for
from .test_inprocess_launcher import Pods, job_store, pods

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(300)]
__all__ = ["job_store", "pods"]  # the fixtures, imported for the tests below
SCRIPT = Path(__file__).with_name("loader_workers_script.py")
# What torch's DataLoader raises in the trainer when one of its workers died of a signal.
LOADER_DIED = "DataLoader worker"


def pids(out: Path, role: str) -> list[int]:
    """The PIDs loader_workers_script.py noted for `role` (trainer, loader)."""
    lines = (out / "pids").read_text().split("\n") if (out / "pids").exists() else []
    return [int(pid) for r, _, pid in (line.partition(" ") for line in lines) if r == role]


def gone(pid: int) -> bool:
    """Exited (a zombie left to its reaper counts: it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def assert_no_loader_worker_left(out: Path) -> None:
    loaders = pids(out, "loader")
    assert loaders, "the script noted no loader worker"
    wait_for(lambda: all(gone(p) for p in loaders), "every loader worker gone", timeout=30)


def test_a_notice_with_loader_workers_saves_the_step_and_the_job_resumes_from_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_OUT", str(tmp_path))
    env = {"ELASTRAIN_STEPS": "60", "ELASTRAIN_CHECKPOINT_URI": f"file://{tmp_path}/ckpt",
           "ELASTRAIN_CHECKPOINT_INTERVAL_STEPS": "20", "ELASTRAIN_CHECKPOINT_KEEP": "100",
           "ELASTRAIN_METRICS_PORT": "0", "ELASTRAIN_STEP_SLEEP_SECONDS": "0.1",
           "OMP_NUM_THREADS": "1"}
    cluster = LocalCluster(env, 1, 2, tmp_path / "logs", job_id=tmp_path.name,
                           entry=(str(SCRIPT),), on_record=lambda agent, r: None)
    codes = preempt_second_agent_at(cluster, 25)
    logs = {a.name: a.log_path.read_text(errors="replace") for a in cluster.agents}
    assert not [n for n, text in logs.items() if LOADER_DIED in text], logs["agent-1"][-3000:]
    records = [r for _, r in cluster.records]
    stopping = [r for name, r in cluster.records
                if name == "agent-1" and r["event"] == "stopping" and r["signalled"]]
    assert len(stopping) == 1, logs["agent-1"][-3000:]
    step = stopping[0]["step"]
    assert step in {r["step"] for r in records if r["event"] == "checkpoint_saved"}
    assert (tmp_path / "ckpt" / f"step-{step:08d}").is_dir()
    assert [r["step"] for r in records if r["event"] == "resumed"] == [step]
    assert codes["agent-0"] == 0, logs["agent-0"][-3000:]
    assert [r["step"] for r in records if r["event"] == "finished"] == [60]
    assert_no_loader_worker_left(tmp_path)


def test_a_notice_with_loader_workers_leaves_in_process_at_a_step_boundary(
        pods: Pods, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_OUT", str(pods.root))
    for node in ("a", "b"):
        pods.start(node, 2, entry=(str(SCRIPT),))
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 2", timeout=180)
    survivor = pods.worker_pid("a")
    pods.procs["b"].send_signal(signal.SIGTERM)  # the kubelet signals the pod's PID 1 only
    codes = pods.wait_all()
    logs = {n: pods.log(n) for n in codes}
    assert codes == {"a": 0, "b": 0}, logs
    assert not [n for n, text in logs.items() if LOADER_DIED in text], logs
    assert [r["event"] for r in pods.records("b") if r["event"] == "left"] == ["left"], logs["b"]
    reasons = [r["reason"] for r in pods.all_records() if r["event"] == "regroup"]
    assert reasons == ["start", "leave"], reasons
    trainers = pids(pods.root, "trainer")
    assert len(trainers) == 2 and survivor in trainers, trainers  # no trainer restarted
    assert_no_loader_worker_left(pods.root)


# --- torch's worker context itself: who the notice reaches, who dies at the deadline

TRAINER = """
import os, signal, sys, time
out, stops = sys.argv[1], sys.argv[2] == "stops"
if os.fork() == 0:  # a helper in the trainer's process group, as a DataLoader worker is
    signal.signal(signal.SIGTERM, lambda *_: open(out + "/helper-noticed", "w").close())
    open(out + "/helper", "w").write(str(os.getpid()))
    while True:
        time.sleep(1)
def notice(*_):
    open(out + "/noticed", "w").close()
    if stops:
        os._exit(0)
signal.signal(signal.SIGTERM, notice)
while not os.path.exists(out + "/helper"):
    time.sleep(0.01)
open(out + "/ready", "w").close()
while True:
    time.sleep(1)
"""


@pytest.fixture
def notice_patched() -> Iterator[None]:
    """torch's classes patched as the launcher does; restored after, with the signal handlers
    torch's context installs in this process."""
    close, close_all = SubprocessHandler.close, SubprocessContext._close
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                 signal.SIGQUIT)}
    launch_agent.patch_notice_to_trainer()
    yield
    SubprocessHandler.close = close  # type: ignore[method-assign]
    SubprocessContext._close = close_all  # type: ignore[method-assign]
    for s, h in handlers.items():
        signal.signal(s, h)


@pytest.mark.parametrize("stops", [True, False], ids=["trainer-stops", "trainer-ignores"])
def test_the_notice_reaches_the_trainer_only_and_its_group_dies_at_the_end(
        notice_patched: None, tmp_path: Path, stops: bool) -> None:
    context: Any = start_processes(
        "notice", sys.executable, {0: ("-c", TRAINER, str(tmp_path), "stops" if stops else "")},
        {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    wait_for(lambda: (tmp_path / "ready").exists(), "the trainer and its helper", timeout=30)
    context.close(signal.SIGTERM, timeout=2)
    trainer = context.subprocess_handlers[0].proc
    assert (tmp_path / "noticed").exists()
    assert not (tmp_path / "helper-noticed").exists()  # the notice was the trainer's alone
    assert trainer.returncode == (0 if stops else -signal.SIGKILL)
    helper = int((tmp_path / "helper").read_text())
    wait_for(lambda: gone(helper), "the helper gone", timeout=10)
