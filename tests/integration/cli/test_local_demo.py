"""The README's main job: `elastrain run --local --simulate-preemption` on the embedded default.

Real torchrun agents against a real rendezvous store; one agent is SIGTERMed mid-run and
replaced. Async checkpoints every 10 steps run while the stop agreement runs every step, which
is how a shared gloo group between the two once deadlocked this demo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(420)]


def test_demo_survives_a_preemption_and_loses_no_step(tmp_path: Path) -> None:
    out = tmp_path / "run"
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "elastrain_cli", "run", "--local", "--simulate-preemption",
         "--fresh", "--out", str(out), "--checkpoint-uri", f"file://{ckpt}"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "preempting agent-1" in proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] is True and summary["final_step"] == 80
    assert summary["resumes"] >= 1 and summary["steps_lost"] == 0
    assert summary["checkpoints_failed"] == 0
    assert (out / "loss.png").stat().st_size > 10_000
    assert (ckpt / "latest").read_text().strip().endswith("00000080")
