"""The README's main job, `make demo`: `elastrain run --local --simulate-preemption --fresh` on
the embedded default, and `make demo-restart`, the same run with `--recovery Restart`.

Real agents under elastrain's launcher against a real store; one agent is SIGTERMed a third of
the way in and a replacement started. The default job runs in process, the mode the operator
picks for it: the survivor trains on at world 1 in the same process, the replacement joins
healed from it, nothing is reloaded and no step is lost or trained twice. With `--recovery
Restart` every worker restarts and the group resumes from the step saved on the notice. Async
checkpoints every 10 steps run while the stop agreement runs every step, which is how a shared
gloo group between the two once deadlocked this demo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.events import parse_line

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(240)]
STEPS = 80  # the embedded job's


def run_demo(tmp: Path, *options: str) -> tuple[str, dict[str, Any], list[tuple[str, Any]]]:
    """The CLI's output, summary.json and every agent's records, (agent, record)."""
    out, ckpt = tmp / "run", tmp / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "elastrain_cli", "run", "--local", "--simulate-preemption",
         "--fresh", "--out", str(out), "--checkpoint-uri", f"file://{ckpt}", *options],
        capture_output=True, text=True, timeout=220, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "preempting agent-1" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] is True and summary["final_step"] == STEPS, summary
    assert summary["steps_lost"] == 0 and summary["checkpoints_failed"] == 0, summary
    assert (out / "loss.png").stat().st_size > 10_000
    assert (ckpt / "latest").read_text().strip().endswith(f"{STEPS:08d}")
    records = [(log.stem, r) for log in sorted(out.glob("agent-*.log"))
               for line in log.read_text().splitlines() if (r := parse_line(line)) is not None]
    return proc.stdout, summary, records


def pids(records: list[tuple[str, Any]], agent: str) -> set[int]:
    return {r["pid"] for a, r in records if a == agent}


def test_the_demo_recovers_in_process(tmp_path: Path) -> None:
    stdout, summary, records = run_demo(tmp_path)
    # The survivor, agent-0 (rank 0 throughout: survivors keep their order), announced both
    # changes, in the one process it had from the start.
    survivor = [(r["reason"], r["world_size"]) for a, r in records
                if a == "agent-0" and r["event"] == "regroup" and r["reason"] != "start"]
    assert survivor == [("leave", 1), ("join", 2)], survivor
    assert len(pids(records, "agent-0")) == 1, pids(records, "agent-0")
    # The replacement took its state from the live survivor, not from a checkpoint.
    joined = [r for a, r in records if a == "agent-2" and r["event"] == "regroup"]
    assert [(r["reason"], r["healed_from"]) for r in joined] == [("join", "agent-0")], joined
    assert not any(r["event"] == "resumed" for _, r in records)
    steps = sorted(r["step"] for _, r in records if r["event"] == "step")
    assert steps == list(range(1, STEPS + 1))  # every step trained once
    assert summary["world_sizes"] == [2, 1, 2] and summary["regroups"] == 2, summary
    assert summary["heals"] == ["agent-2 from agent-0"], summary
    last = [ln for ln in stdout.splitlines() if ln.startswith("elastrain: finished=")][-1]
    assert "recovery=InProcess regroups=2 (leave, join) survivor_pause_s=[" in last, last
    assert "steps_lost=0" in last, last


def test_recovery_restart_runs_the_restart_path(tmp_path: Path) -> None:
    stdout, summary, records = run_demo(tmp_path, "--recovery", "restart")
    assert not any(r["event"] == "regroup" for _, r in records)
    resumed = [r for _, r in records if r["event"] == "resumed"]
    # The survivor resumed in a restarted process. The replacement may resume in its first
    # one: on a loaded machine it can start after the survivor's round closed at world 1 (the
    # job's minReplicas), and then joins the next round (world_sizes [2, 1, 2]).
    survivor = [r for a, r in records if a == "agent-0" and r["event"] == "resumed"]
    assert survivor and all(r["restart_count"] >= 1 for r in survivor), resumed
    assert summary["resumes"] >= 1, summary
    # The worker that was not signalled restarted too: a new process resumed the checkpoint.
    assert len(pids(records, "agent-0")) >= 2, pids(records, "agent-0")
    last = [ln for ln in stdout.splitlines() if ln.startswith("elastrain: finished=")][-1]
    assert "recovery=Restart resumes=" in last and "steps_lost=0" in last, last
