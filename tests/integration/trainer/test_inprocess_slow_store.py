"""In-process mode through a slow object store: a save whose collectives wait past 30 s (the
in-process collective timeout of old; every in-process collective now waits restart mode's 5
minutes, a silent peer being the heartbeat's to find) still commits. Two in-process nodes of the
built-in trainer save to MinIO through the fault proxy, which holds every request of step 4's
save 9 s (each under boto3's read timeout), so the rank that is not the coordinator waits past
30 s in DCP's closing collective on the checkpoint group while the coordinator writes the
metadata and the commit. Seen on the real node before the checkpoint group got restart mode's
timeout: the save failed at 30 s (gloo recv timeout), and a drain's save that failed so left the
job to start from an older checkpoint. The second test is that drain: the replacements that come
during its slow save wait for it and resume from it."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import make_s3_storage, s3_env
from .fault_proxy import Fault, FaultProxy
from .test_inprocess import wait_for
from .test_inprocess_builtin import job_store, records, start
from .test_inprocess_launcher import Pods, assert_resumed_with_nothing_lost, pods

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]
__all__ = ["job_store", "pods"]  # the fixtures, imported for this module's tests
DELAY_S = 9.0  # per request: under boto3's 30 s read timeout; the coordinator's run is not


def test_a_save_held_past_the_inprocess_collective_timeout_commits(
        job_store: Any, tmp_path: Path, s3_credentials: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    storage = make_s3_storage(s3_credentials)
    host, port = s3_credentials.endpoint_url.removeprefix("http://").split(":")
    for key, value in s3_env(s3_credentials).items():
        monkeypatch.setenv(key, value)
    try:
        with FaultProxy(host, int(port)) as proxy:
            proxy.set(Fault(delay_seconds=DELAY_S, path=r"step-00000004/"))
            extra = {"CHECKPOINT_URI": storage.uri, "CHECKPOINT_ENDPOINT": proxy.endpoint,
                     "CHECKPOINT_INTERVAL_STEPS": "4", "STEPS": "6",
                     "STEP_SLEEP_SECONDS": "0"}
            procs = {n: start(tmp_path, n, job_store.port, "slow-store", 2, **extra)
                     for n in ("a", "b")}
            codes = {n: p.wait(timeout=240) for n, p in procs.items()}
            delayed = proxy.stats["delayed"]
    finally:
        storage.delete(storage.list())
    logs = {n: records(tmp_path / f"{n}.log") for n in procs}
    assert codes == {"a": 0, "b": 0}, {n: (tmp_path / f"{n}.log").read_text()[-3000:]
                                       for n in procs}
    assert delayed >= 1
    failed = [r for n in logs for r in logs[n] if r["event"] == "checkpoint_failed"]
    assert not failed, failed
    saved = {r["step"]: r for n in logs for r in logs[n] if r["event"] == "checkpoint_saved"}
    assert {4, 6} <= set(saved) and saved[4]["total_s"] > 30, saved
    print(f"step 4's save committed in {saved[4]['total_s']:.1f} s ({delayed} requests held "
          f"{DELAY_S} s each)")


# Each request of the stop's save is held (~30 s in all, the launcher's shutdown timeout raised
# to let it finish), so replacements started with the SIGTERM join during it.
STOP_DELAY_S = 2.0
STOP_SHUTDOWN_TIMEOUT = "90"


def test_replacements_that_come_during_a_drains_slow_save_resume_from_it(
        pods: Pods, s3_credentials: Any) -> None:
    """min 2: a and b are evicted together (c alone is below the smallest world), so every node
    saves the step on the old group, here through a slowed store, while the replacements a2 and
    b2 are already up. They must wait for that save (each saver says it is done, or goes
    silent) and resume from it. Seen failing before the stop plan named its savers: a2 and b2
    found a stop with no nodes, started a new generation at once from no checkpoint and
    trained from step 0 (e2e scenario 4 in InProcess mode)."""
    storage = make_s3_storage(s3_credentials)
    host, port = s3_credentials.endpoint_url.removeprefix("http://").split(":")
    try:
        with FaultProxy(host, int(port)) as proxy:
            extra = {"CHECKPOINT_URI": storage.uri, "CHECKPOINT_ENDPOINT": proxy.endpoint,
                     "CHECKPOINT_INTERVAL_STEPS": "1000", "MIN_REPLICAS": "2",
                     "STEPS": "120", "PET_SHUTDOWN_TIMEOUT": STOP_SHUTDOWN_TIMEOUT}
            for node in ("a", "b", "c"):
                pods.start(node, 3, **extra)
            wait_for(lambda: pods.stepped() >= 10, "step 10 at world 3", timeout=180)
            proxy.set(Fault(delay_seconds=STOP_DELAY_S, path=r"/step-\d+/"))
            at = time.time()
            for node in ("a", "b"):
                pods.procs[node].send_signal(signal.SIGTERM)
            for node in ("a2", "b2"):
                pods.start(node, 3, **extra)
            wait_for(lambda: any(r["event"] == "checkpoint_saved" for r in pods.all_records()),
                     "the stop's save committed", timeout=180)
            proxy.set(Fault())
            codes = pods.wait_all()
    finally:
        storage.delete(storage.list())
    assert set(codes.values()) == {0}, {n: pods.log(n) for n in codes}
    recs = pods.all_records()
    stops = {r["step"] for r in recs if r["event"] == "stopping"}
    saved = [r for r in recs if r["event"] == "checkpoint_saved"]
    starts = [r for r in recs if r["event"] == "regroup" and r["reason"] == "start"
              and r["time"] > at]
    print(f"the stop's save: {saved[0]['total_s']:.1f} s; the next start "
          f"{starts[0]['time'] - saved[0]['time']:.2f} s after it committed")
    assert len(stops) == 1 and saved[0]["step"] in stops, (stops, saved)
    assert len(starts) == 1 and starts[0]["time"] > saved[0]["time"], (starts, saved)
    assert_resumed_with_nothing_lost(pods, stops.pop(), steps=120)
