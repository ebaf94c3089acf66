"""In-process mode through a slow object store: a save whose collectives wait past the 30 s
in-process collective timeout still commits. Two in-process nodes of the built-in trainer save
to MinIO through the fault proxy, which holds every request of step 4's save 9 s (each under
boto3's read timeout), so the rank that is not the coordinator waits past 30 s in DCP's closing
collective on the checkpoint group while the coordinator writes the metadata and the commit. Seen
on the real node before the checkpoint group got restart mode's timeout: the save failed at 30 s
(gloo recv timeout), and a drain's save that failed so left the job to start from an older
checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import make_s3_storage, s3_env
from .fault_proxy import Fault, FaultProxy
from .test_inprocess_builtin import job_store, records, start

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]
__all__ = ["job_store"]  # the fixture, imported for this module's test
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
