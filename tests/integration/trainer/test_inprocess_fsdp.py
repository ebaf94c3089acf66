"""FSDP2 (`ELASTRAIN_STRATEGY=fsdp`) with in-process recovery, the built-in trainer on real
processes: three nodes; one leaves with a SIGTERM (its shards handed to the two survivors on the
old group before it exits), later a new node joins (its shards from the survivors on the new
group). Survivors keep their processes. The final model, AdamW state and trainer state are
bit-identical to the same world schedule done by restarts (restart mode at world 3, then a
fresh world-2 job from its checkpoint of the leave's step, then a fresh world-3 job from that
one's checkpoint of the join's step): DCP reshards those loads, `inprocess/reshard.py` the
in-process ones, and both must land every row in the same place."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.ports import free_port

from .conftest import load_checkpoint
from .test_elastic import assert_identical
from .test_inprocess import wait_for
from .test_inprocess_builtin import STEPS, base_env, job_store, records, start

pytestmark = [pytest.mark.timeout(420)]
__all__ = ["job_store"]  # the fixture, imported for this module's tests

# 12 = 3 ranks x 2 micro-batches x 2 and 2 ranks x 2 x 3: both worlds keep the global batch.
FSDP = {"STRATEGY": "fsdp", "GLOBAL_BATCH_SIZE": "12"}


def restart_mode(root: Path, world: int, **extra: str) -> dict[str, int]:
    """`world` restart-mode ranks (env:// rendezvous, today's code path)."""
    root.mkdir()
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "elastrain_trainer"],
        env={**base_env(root, **FSDP, **extra), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
             "LOCAL_RANK": "0"},
        stdout=(root / f"rank{rank}.log").open("wb"), stderr=subprocess.STDOUT)
        for rank in range(world)]
    codes = {f"rank{i}": p.wait(timeout=240) for i, p in enumerate(procs)}
    assert codes == {f"rank{i}": 0 for i in range(world)}, (
        (root / "rank0.log").read_text(errors="replace")[-3000:])
    return codes


def test_fsdp_leave_and_join_in_process_equal_the_same_schedule_by_restarts(
        job_store: Any, tmp_path: Path) -> None:
    root = tmp_path / "inprocess"
    root.mkdir()
    procs = {n: start(root, n, job_store.port, "fsdp-ip", 3, **FSDP) for n in "abc"}
    try:
        def stepped() -> int:
            return max((r["step"] for n in procs for r in records(root / f"{n}.log")
                        if r["event"] == "step"), default=0)
        wait_for(lambda: stepped() >= 6, "step 6")
        procs["c"].send_signal(signal.SIGTERM)
        assert procs["c"].wait(timeout=120) == 0, (root / "c.log").read_text()[-3000:]
        left = next(r for r in records(root / "c.log") if r["event"] == "left")["step"]
        wait_for(lambda: stepped() >= left + 5, f"step {left + 5}")
        procs["d"] = start(root, "d", job_store.port, "fsdp-ip", 3, **FSDP)
        codes = {n: p.wait(timeout=240) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {n: (root / f"{n}.log").read_text(errors="replace")[-3000:] for n in procs}
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, logs
    healed = next(r for r in records(root / "d.log")
                  if r["event"] == "regroup" and r.get("healed_from"))
    joined = healed["step"]
    worlds = {r["step"]: r["world_size"] for n in procs for r in records(root / f"{n}.log")
              if r["event"] == "step"}
    assert sorted(worlds) == list(range(1, STEPS + 1))  # every step once: 0 lost
    assert [worlds[s] for s in range(1, STEPS + 1)] == (
        [3] * left + [2] * (joined - left) + [3] * (STEPS - joined)), worlds
    # a and b are one process each (no launcher could restart them), through three
    # generations (each logged by its rank 0), and never loaded a checkpoint.
    survivors = [r for n in "ab" for r in records(root / f"{n}.log")]
    regroups = {r["gen"]: r for n in "abc" for r in records(root / f"{n}.log")
                if r["event"] == "regroup"}
    assert [(g, r["reason"], r["world_size"]) for g, r in sorted(regroups.items())] == [
        (1, "start", 3), (2, "leave", 2), (3, "join", 3)], regroups
    assert not [r for r in survivors if r["event"] == "resumed"]
    print(f"left at step {left}, joined at step {joined}; regroup_s / heal_s: "
          f"{[(r['reason'], r['regroup_s'], r['heal_s']) for _, r in sorted(regroups.items())]}"
          f", the joiner's {healed['heal_s']}")

    # The same schedule by restarts; DCP reshards each load.
    restart_mode(tmp_path / "r3", 3)
    restart_mode(tmp_path / "r2", 2, RESUME_FROM=f"file://{tmp_path}/r3/ckpt/step-{left:08d}")
    restart_mode(tmp_path / "r3b", 3,
                 RESUME_FROM=f"file://{tmp_path}/r2/ckpt/step-{joined:08d}")
    want = load_checkpoint(tmp_path / "r3b" / "ckpt", STEPS, tmp_path)
    got = load_checkpoint(root / "ckpt", STEPS, tmp_path)
    assert want.keys() == got.keys() and {"model", "optim", "trainer"} <= set(got)
    for part in want:
        assert_identical(want[part], got[part], part)
