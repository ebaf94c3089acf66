"""The Session API in in-process mode (ELASTRAIN_RECOVERY=inProcess), on real processes: a BYO
script that reads env.rank / env.world_size in its loop (inprocess_session_script.py) trains
through a leave with notice and a cold joiner without any survivor restarting, and the job's
final checkpoint commits. Restart mode (the default) is covered, unchanged, by test_byo,
test_elastic and tests/unit/trainer/test_api.py."""

from __future__ import annotations

import json
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

from tests.warmstart import started_pid

from .test_inprocess import events, steps_of, wait_for

pytestmark = [pytest.mark.timeout(300)]
SCRIPT = Path(__file__).with_name("inprocess_session_script.py")
STEPS = 150


@pytest.fixture
def job_store() -> Iterator[Any]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                        wait_for_workers=False, use_libuv=True, timeout=timedelta(seconds=60))


def test_session_trains_through_a_leave_and_a_join_without_restarting_survivors(
        job_store: Any, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "TEST_OUT": str(tmp_path), "ELASTRAIN_RECOVERY": "inProcess",
           "ELASTRAIN_STORE": f"127.0.0.1:{job_store.port}", "ELASTRAIN_RUN_ID": "session-test",
           "ELASTRAIN_REPLICAS": "3", "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": "2",
           "ELASTRAIN_GLOBAL_BATCH_SIZE": "12", "ELASTRAIN_MICRO_BATCH_SIZE": "2",
           "ELASTRAIN_STEPS": str(STEPS), "ELASTRAIN_STEP_SLEEP_SECONDS": "0.1",
           "ELASTRAIN_CHECKPOINT_URI": f"file://{tmp_path}/ckpt",
           "ELASTRAIN_CHECKPOINT_INTERVAL_STEPS": "40", "ELASTRAIN_METRICS_PORT": "0"}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(node: str) -> None:
        procs[node] = subprocess.Popen(
            [sys.executable, str(SCRIPT)], env={**env, "ELASTRAIN_NODE_ID": node},
            stdout=(tmp_path / f"{node}.log").open("wb"), stderr=subprocess.STDOUT)

    try:
        for n in "abc":
            start(n)
        wait_for(lambda: len(steps_of(events(tmp_path, "c"))) >= 5, "c at step 5")
        procs["c"].send_signal(signal.SIGTERM)
        wait_for(lambda: procs["c"].poll() is not None, "c gone")
        start("d")  # a cold replacement: imports, builds, joins the live job
        codes = {n: p.wait(timeout=240) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {n: (tmp_path / f"{n}.log").read_text(errors="replace") for n in procs}
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, {n: t[-3000:] for n, t in logs.items()}
    ev = {n: events(tmp_path, n) for n in "abcd"}
    left = next(json.loads(line) for line in logs["c"].splitlines()
                if line.startswith("{") and '"left"' in line)
    for n in "ab":
        assert {e["pid"] for e in ev[n]} == {started_pid(procs[n].pid)}, n
        assert steps_of(ev[n]) == list(range(1, STEPS + 1)), n
        worlds = [e["world"] for e in ev[n] if e["event"] == "step"]
        assert worlds[0] == 3 and worlds[-1] == 3 and 2 in worlds, worlds
    entered = ev["d"][0]
    assert entered["event"] == "entered" and entered["step"] > left["step"]
    assert entered["world"] == 3 and entered["rank"] == 2
    assert steps_of(ev["d"]) == list(range(entered["step"] + 1, STEPS + 1))
    regroups = [json.loads(line) for line in logs["d"].splitlines()
                if line.startswith("{") and '"regroup"' in line]
    assert regroups and regroups[0]["healed_from"] in {"a", "b"}, logs["d"][-3000:]
    finals = {n: next(e for e in ev[n] if e["event"] == "finished")["digest"] for n in "abd"}
    assert len(set(finals.values())) == 1, finals
    assert (tmp_path / "ckpt" / f"step-{STEPS:08d}").exists()


def session_records(log: str, event: str) -> list[dict[str, Any]]:
    return [r for r in (json.loads(line) for line in log.splitlines() if line.startswith("{"))
            if r.get("event") == event]


def run_job(root: Path, port: int, run: str, **c_env: str) -> dict[str, Any]:
    """Nodes a, b, c at world 3 on the README loop (c with `c_env`), to the end."""
    root.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "TEST_OUT": str(root), "ELASTRAIN_RECOVERY": "inProcess",
           "ELASTRAIN_STORE": f"127.0.0.1:{port}", "ELASTRAIN_RUN_ID": run,
           "ELASTRAIN_REPLICAS": "3", "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": "2",
           "ELASTRAIN_GLOBAL_BATCH_SIZE": "12", "ELASTRAIN_MICRO_BATCH_SIZE": "2",
           "ELASTRAIN_STEPS": str(KILL_STEPS), "ELASTRAIN_STEP_SLEEP_SECONDS": "0",
           "TEST_BODY_SLEEP_SECONDS": "0.1",
           "ELASTRAIN_CHECKPOINT_URI": f"file://{root}/ckpt",
           "ELASTRAIN_CHECKPOINT_INTERVAL_STEPS": "20", "ELASTRAIN_METRICS_PORT": "0"}
    procs = {n: subprocess.Popen(
        [sys.executable, str(SCRIPT)],
        env={**env, "ELASTRAIN_NODE_ID": n, **(c_env if n == "c" else {})},
        stdout=(root / f"{n}.log").open("wb"), stderr=subprocess.STDOUT) for n in "abc"}
    try:
        codes = {n: p.wait(timeout=240) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {n: (root / f"{n}.log").read_text(errors="replace") for n in procs}
    return {"codes": codes, "logs": logs, "pids": {n: started_pid(p.pid) for n, p in procs.items()},
            "ev": {n: events(root, n) for n in "abc"}}


KILL_STEPS, KILL_AT = 40, 8


def test_session_survives_a_killed_peer_in_process_and_redoes_the_lost_step_exactly(
        job_store: Any, tmp_path: Path) -> None:
    """The README loop, unchanged, at world 3; node c SIGKILLs itself at the start of the body
    of step index 8 (no notice), while a and b sleep in theirs: they lose it in DDP's
    all-reduce in backward(), outside steps(). The Session's comm hook notes the loss, the
    optimizer applies nothing, and steps() recovers at the next yield and redoes that step at
    world 2. The survivors end bit-identical to a run where c left with notice after step 8
    (0 steps lost; world 3 for steps 1-8, world 2 from 9, the schedule test_inprocess proves
    equal to restart-and-load): the failed step left nothing behind."""
    job = run_job(tmp_path / "kill", job_store.port, "session-kill", TEST_SIGKILL_AT=str(KILL_AT))
    ref = run_job(tmp_path / "leave", job_store.port, "session-leave",
                  TEST_SIGTERM_AT=str(KILL_AT - 1))
    for r, c_code in ((job, -signal.SIGKILL), (ref, 0)):
        assert r["codes"] == {"a": 0, "b": 0, "c": c_code}, {
            n: t[-3000:] for n, t in r["logs"].items()}
    logs, ev = job["logs"], job["ev"]
    lost = {n: session_records(logs[n], "peer_lost") for n in "ab"}
    assert all(len(v) == 1 and v[0]["in_body"] and v[0]["step"] == KILL_AT
               for v in lost.values()), lost
    fails = [r for n in "ab" for r in session_records(logs[n], "regroup")
             if r["reason"] != "start"]
    assert [(r["world_size"], r["reason"], r["step"]) for r in fails] == [(2, "fail", KILL_AT)]
    for n in "ab":
        assert {e["pid"] for e in ev[n]} == {job["pids"][n]}, n
        worlds = [(e["step"], e["world"]) for e in ev[n] if e["event"] == "step"]
        # Each body that ran to its end: step 9 twice, at world 3 (lost) and at world 2.
        assert worlds == ([(s, 3) for s in range(1, KILL_AT + 2)]
                          + [(s, 2) for s in range(KILL_AT + 1, KILL_STEPS + 1)]), worlds
        ref_worlds = [(e["step"], e["world"]) for e in ref["ev"][n] if e["event"] == "step"]
        assert ref_worlds == worlds[:KILL_AT] + worlds[KILL_AT + 1:], ref_worlds
    # Model, optimizer and the scheduler the body steps: the lost body's step was undone.
    finals = {f"{k}/{n}": tuple(next(e for e in r["ev"][n] if e["event"] == "finished")[f]
                                for f in ("digest", "scheduler_epoch"))
              for k, r in (("kill", job), ("leave", ref)) for n in "ab"}
    assert len(set(finals.values())) == 1 and finals["kill/a"][1] == KILL_STEPS, finals
    assert (tmp_path / "kill" / "ckpt" / f"step-{KILL_STEPS:08d}").exists()
    t_lost = min(r["time"] for v in lost.values() for r in v)
    print(f"peer lost -> regrouped at world 2 in {fails[0]['time'] - t_lost:.2f} s")
