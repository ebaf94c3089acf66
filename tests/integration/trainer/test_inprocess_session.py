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
        assert {e["pid"] for e in ev[n]} == {procs[n].pid}, n
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
