"""The built-in trainer (python -m elastrain_trainer) with ELASTRAIN_RECOVERY=inProcess, on real
processes: two nodes, one leaves with a SIGTERM, the survivor trains on alone in the same
process. Its final state is bit-identical to the same schedule by restart: two restart-mode
processes at world 2 (plain env:// rendezvous), then a fresh process that resumes at world 1
from their checkpoint of the leave's step. That holds only if the trainer reads the world size
inside its loop (2 micro-batches per step at world 2, 4 at world 1; the node starts alone, so a
value read before the loop is the world of one's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from elastrain_trainer.events import parse_line
from elastrain_trainer.ports import free_port

from .conftest import load_checkpoint, trainer_env
from .test_elastic import assert_identical
from .test_inprocess import wait_for

pytestmark = [pytest.mark.timeout(300)]
STEPS = 24


@pytest.fixture
def job_store() -> Iterator[Any]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                        wait_for_workers=False, use_libuv=True, timeout=timedelta(seconds=60))


def records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    out = [parse_line(line) for line in log.read_text(errors="replace").splitlines()]
    return [r for r in out if r is not None]


def base_env(root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo",
            **trainer_env(root, **{"STEPS": str(STEPS), "CHECKPOINT_INTERVAL_STEPS": "1",
                                   "CHECKPOINT_KEEP": "100", "CHECKPOINT_ASYNC": "0", **extra})}


def start(root: Path, node: str, port: int, run: str, replicas: int,
          **extra: str) -> subprocess.Popen[bytes]:
    env = {**base_env(root, **{"STEP_SLEEP_SECONDS": "0.1", **extra}),
           "ELASTRAIN_RECOVERY": "inProcess", "ELASTRAIN_STORE": f"127.0.0.1:{port}",
           "ELASTRAIN_NODE_ID": node, "ELASTRAIN_RUN_ID": run,
           "ELASTRAIN_REPLICAS": str(replicas), "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": "2"}
    return subprocess.Popen([sys.executable, "-m", "elastrain_trainer"], env=env,
                            stdout=(root / f"{node}.log").open("wb"), stderr=subprocess.STDOUT)


def restart_mode_pair(root: Path) -> dict[str, int]:
    """Two restart-mode ranks at world 2 (env:// rendezvous, today's code path)."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "elastrain_trainer"],
        env={**base_env(root), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
        stdout=(root / f"rank{rank}.log").open("wb"), stderr=subprocess.STDOUT)
        for rank in range(2)]
    return {f"rank{i}": p.wait(timeout=240) for i, p in enumerate(procs)}


def test_builtin_trainer_survivor_equals_a_restart_at_the_smaller_world(
        job_store: Any, tmp_path: Path) -> None:
    a_root, b_root = tmp_path / "inprocess", tmp_path / "restart"
    a_root.mkdir()
    b_root.mkdir()
    procs = {n: start(a_root, n, job_store.port, "builtin-a", 2) for n in ("a", "b")}
    try:
        def stepped() -> int:
            return max((r["step"] for n in procs for r in records(a_root / f"{n}.log")
                        if r["event"] == "step"), default=0)
        wait_for(lambda: stepped() >= 6, "step 6")
        procs["b"].send_signal(signal.SIGTERM)
        codes = {n: p.wait(timeout=240) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {n: (a_root / f"{n}.log").read_text(errors="replace")[-3000:] for n in procs}
    assert codes == {"a": 0, "b": 0}, logs
    left = next(r for r in records(a_root / "b.log") if r["event"] == "left")["step"]
    worlds = {r["step"]: r["world_size"] for n in procs for r in records(a_root / f"{n}.log")
              if r["event"] == "step"}
    assert sorted(worlds) == list(range(1, STEPS + 1))  # every step once: 0 lost
    assert {worlds[s] for s in range(1, left + 1)} == {2}
    assert {worlds[s] for s in range(left + 1, STEPS + 1)} == {1}

    # The same schedule by restart: world 2 in restart mode, then a new process at world 1
    # from its checkpoint of the leave's step.
    pair_root = tmp_path / "pair"
    pair_root.mkdir()
    assert restart_mode_pair(pair_root) == {"rank0": 0, "rank1": 0}, (
        (pair_root / "rank0.log").read_text()[-3000:])
    solo = start(b_root, "solo", job_store.port, "builtin-b", 1,
                 RESUME_FROM=f"file://{pair_root}/ckpt/step-{left:08d}")
    assert solo.wait(timeout=240) == 0, (b_root / "solo.log").read_text()[-3000:]
    resumed = next(r for r in records(b_root / "solo.log") if r["event"] == "resumed")
    assert resumed["step"] == left and resumed["saved_world_size"] == 2
    want = load_checkpoint(b_root / "ckpt", STEPS, tmp_path)
    got = load_checkpoint(a_root / "ckpt", STEPS, tmp_path)
    assert want.keys() == got.keys() and {"model", "optim", "trainer"} <= set(got)
    for part in want:
        assert_identical(want[part], got[part], part)


# "boundary": the 0.1 s step sleep and a save per step (both in steps()) take most of a step;
# "body": no sleep, no save until the last step, so the kill lands in the body and the survivor
# meets it in backward's or the loss's all-reduce (each run prints which).
@pytest.mark.parametrize("timing", [{}, {"STEP_SLEEP_SECONDS": "0",
                                         "CHECKPOINT_INTERVAL_STEPS": "1000"}],
                         ids=["boundary", "body"])
def test_builtin_trainer_survivor_of_a_killed_peer_equals_a_restart_at_the_smaller_world(
        job_store: Any, tmp_path: Path, timing: dict[str, str]) -> None:
    """The built-in trainer, 2 nodes, b SIGKILLed mid-run (no notice): a keeps its process
    (one Popen, no launcher that could restart it: its exit 0 after the regroup is the proof),
    notes the loss (in backward's or the loss's all-reduce, or in the step boundary: whichever
    collective met it first), redoes the step in flight from its committed state at world 1,
    and ends bit-identical to restart mode at world 2 then a fresh world-1 process resuming
    from the checkpoint of the step a resumed at (<= 1 step lost)."""
    a_root, b_root = tmp_path / "inprocess", tmp_path / "restart"
    a_root.mkdir()
    b_root.mkdir()
    procs = {n: start(a_root, n, job_store.port, "builtin-kill", 2, **timing)
             for n in ("a", "b")}
    try:
        def stepped() -> int:
            return max((r["step"] for n in procs for r in records(a_root / f"{n}.log")
                        if r["event"] == "step"), default=0)
        wait_for(lambda: stepped() >= 6, "step 6")
        procs["b"].kill()
        codes = {n: p.wait(timeout=240) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    log_a = records(a_root / "a.log")
    assert codes == {"a": 0, "b": -signal.SIGKILL}, (a_root / "a.log").read_text()[-3000:]
    lost = [r for r in log_a if r["event"] == "peer_lost"]
    fail = [r for r in log_a if r["event"] == "regroup" and r["reason"] == "fail"]
    assert len(lost) == 1 and len(fail) == 1 and fail[0]["world_size"] == 1, (lost, fail)
    resumed = fail[0]["step"]
    assert resumed == lost[0]["step"]  # nothing committed lost; the step in flight redone
    print(f"peer lost at step {resumed} (in_body={lost[0]['in_body']}), regrouped at world 1 "
          f"in {fail[0]['time'] - lost[0]['time']:.2f} s")
    after = [(r["step"], r["world_size"]) for r in log_a
             if r["event"] == "step" and r["time"] > fail[0]["time"]]
    assert after == [(s, 1) for s in range(resumed + 1, STEPS + 1)], after

    pair_root = tmp_path / "pair"
    pair_root.mkdir()
    assert restart_mode_pair(pair_root) == {"rank0": 0, "rank1": 0}, (
        (pair_root / "rank0.log").read_text()[-3000:])
    solo = start(b_root, "solo", job_store.port, "builtin-kill-ref", 1,
                 RESUME_FROM=f"file://{pair_root}/ckpt/step-{resumed:08d}")
    assert solo.wait(timeout=240) == 0, (b_root / "solo.log").read_text()[-3000:]
    want = load_checkpoint(b_root / "ckpt", STEPS, tmp_path)
    got = load_checkpoint(a_root / "ckpt", STEPS, tmp_path)
    assert want.keys() == got.keys() and {"model", "optim", "trainer"} <= set(got)
    for part in want:
        assert_identical(want[part], got[part], part)
