"""The trainer as one real process (`python -m elastrain_trainer`, a world of one): fp16 with
its grad scaler through a checkpoint, and an object store that goes away mid-run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.checkpoint.s3 import S3Storage
from elastrain_trainer.events import parse_line

from .conftest import load_checkpoint, make_s3_storage, s3_env, subprocess_env, trainer_env
from .tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(240)


def run_trainer(env: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    proc = subprocess.run([sys.executable, "-m", "elastrain_trainer"], env=subprocess_env(env),
                          capture_output=True, text=True, timeout=180)
    recs = [r for r in map(parse_line, proc.stdout.splitlines()) if r is not None]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode, recs


def test_fp16_run_resumes_with_its_grad_scaler(tmp_path: Path) -> None:
    env = trainer_env(tmp_path / "resumed", precision="fp16", steps="6",
                      checkpoint_interval_steps="3")
    _, first = run_trainer(env)
    _, second = run_trainer({**env, "ELASTRAIN_STEPS": "9"})
    resumed = next(r for r in second if r["event"] == "resumed")
    assert resumed["step"] == 6
    steps = [r for r in first + second if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 10))
    assert all(math.isfinite(r["loss"]) for r in steps)
    meta = json.loads((tmp_path / "resumed" / "ckpt" / "step-00000009" / "manifest.json")
                      .read_text())
    assert meta["step"] == 9
    # The same 9 steps in one go: the scaler's state (scale and the growth tracker, which counts
    # steps since the scale last changed) must come out identical only if the resume restored it.
    run_trainer(trainer_env(tmp_path / "straight", precision="fp16", steps="9",
                            checkpoint_interval_steps="3"))
    scaler = {run: load_checkpoint(tmp_path / run / "ckpt", 9, tmp_path)["trainer"]["scaler"]
              for run in ("resumed", "straight")}
    assert scaler["straight"]["_growth_tracker"] > 3, scaler  # more than the steps after resume
    assert scaler["resumed"] == scaler["straight"]


@pytest.mark.s3
def test_store_outage_during_saves_does_not_stop_training(
        s3_credentials: Any, tmp_path: Path) -> None:
    s3 = s3_credentials
    host, port = s3.endpoint_url.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port)).start()
    storage: S3Storage = make_s3_storage(s3, endpoint=s3.endpoint_url)
    env = {**trainer_env(tmp_path, steps="40", checkpoint_interval_steps="2",
                         step_sleep_seconds="0.1", checkpoint_uri=storage.uri,
                         checkpoint_endpoint=proxy.endpoint), **s3_env(s3)}
    proc = subprocess.Popen([sys.executable, "-m", "elastrain_trainer"],
                            env=subprocess_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    recs: list[dict[str, Any]] = []
    cond = threading.Condition()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if (r := parse_line(line)) is not None:
                with cond:
                    recs.append(r)
                    cond.notify_all()

    def wait_for(event: str, min_step: int = 0) -> dict[str, Any]:
        with cond:
            assert cond.wait_for(lambda: any(r["event"] == event and r.get("step", 0) >= min_step
                                             for r in recs), timeout=120), event
            return next(r for r in recs if r["event"] == event and r.get("step", 0) >= min_step)

    threading.Thread(target=pump, daemon=True).start()
    try:
        wait_for("checkpoint_saved", 2)
        proxy.cut()
        failed = wait_for("checkpoint_failed")
        trained_during_outage = wait_for("step", failed["step"] + 4)
        proxy.heal()
        assert proc.wait(timeout=150) == 0
    finally:
        proxy.cut()
        if proc.poll() is None:
            proc.kill()
    assert trained_during_outage["step"] > failed["step"]
    saved_after = [r["step"] for r in recs
                   if r["event"] == "checkpoint_saved" and r["step"] > failed["step"]]
    assert saved_after and saved_after[-1] == 40
    assert failed["step"] not in [c.step for c in scan(storage).commits]
    assert storage.read(mf.LATEST) == b"step-00000040"
    storage.delete(storage.list())


def test_fsdp_bf16_activation_checkpointing_text_wsd_guard_combine(tmp_path: Path) -> None:
    env = trainer_env(tmp_path, strategy="fsdp", precision="bf16", dataset="text",
                      activation_checkpointing="1", lr_schedule="wsd", spike_factor="4",
                      steps="8", checkpoint_interval_seconds="1", step_sleep_seconds="0.2")
    _, recs = run_trainer(env)
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert any(r["event"] == "checkpoint_saved" and r["step"] < 8 for r in recs)
    sidecar = json.loads((tmp_path / "ckpt" / "step-00000008" / "sidecar.json").read_text())
    assert (sidecar["strategy"], sidecar["step"], sidecar["world_size"]) == ("fsdp", 8, 1)


@pytest.mark.s3
def test_a_run_whose_final_checkpoint_fails_does_not_finish(
        s3_credentials: Any, tmp_path: Path) -> None:
    """The store goes away for the final save: the trainer must not report "finished" and exit 0
    (the job would end Succeeded with an older checkpoint); it exits 1 with the reason, so the
    operator counts it and a replacement resumes and saves the end again."""
    s3 = s3_credentials
    host, port = s3.endpoint_url.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port)).start()
    storage: S3Storage = make_s3_storage(s3, endpoint=s3.endpoint_url)
    env = {**trainer_env(tmp_path, steps="12", checkpoint_interval_steps="4",
                         step_sleep_seconds="0.3", checkpoint_uri=storage.uri,
                         checkpoint_endpoint=proxy.endpoint, checkpoint_async="0"),
           **s3_env(s3), "AWS_MAX_ATTEMPTS": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "elastrain_trainer"],
                            env=subprocess_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            r = parse_line(line)
            if r is not None and r["event"] == "step" and r["step"] == 11:
                proxy.cut()  # before step 12 ends: the final save cannot reach the store
        code = proc.wait(timeout=180)
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        proxy.heal()
        if proc.poll() is None:
            proc.kill()
    records = [r for r in map(parse_line, lines) if r is not None]
    assert code == 1, stderr[-2000:]
    assert not [r for r in records if r["event"] == "finished"]
    assert "FinalCheckpointError: the final checkpoint (step 12) was not committed" in stderr
    assert storage.read(mf.LATEST) == b"step-00000008"
    storage.delete(storage.list())


def test_a_run_told_to_start_over_keeps_the_old_work_and_resumes_its_own(
        tmp_path: Path) -> None:
    env = trainer_env(tmp_path, steps="8", checkpoint_interval_steps="4", checkpoint_keep="5",
                      checkpoint_async="0")
    run_trainer(env)  # commits 4 and 8
    old = {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()
           and p.name != "latest"}
    fresh = {**env, "ELASTRAIN_CHECKPOINT_RESUME": "never", "ELASTRAIN_RUN_ID": "run-2",
             "ELASTRAIN_STEPS": "4"}
    _, first = run_trainer(fresh)
    assert [r["event"] for r in first if r["event"] in ("resumed", "fresh_start")] == [
        "fresh_start"]
    # Its step 4 went beside the old one; nothing old was touched.
    assert all(p.read_bytes() == data for p, data in old.items())
    assert (tmp_path / "ckpt" / "step-00000004.2" / "COMMITTED").exists()
    # Restarted, it resumes its own step 4, not the older run's 8.
    _, second = run_trainer({**fresh, "ELASTRAIN_STEPS": "6"})
    resumed = next(r for r in second if r["event"] == "resumed")
    assert resumed["step"] == 4 and resumed["uri"].endswith("step-00000004.2")
