"""Lose no work when the store misbehaves (issue 17): real torchrun trainers resume from the real
MinIO through a fault proxy (fault_proxy.FaultProxy) that resets larger responses, answers
503 SlowDown, or flips a byte of a request body; and a shard damaged on purpose.

What must hold: a store fault never makes a checkpoint look damaged (no `checkpoint_skipped`, no
`fresh_start`, resumed from the newest step on every rank); a fault that outlasts
ELASTRAIN_CHECKPOINT_WAIT_SECONDS stops the worker with the reason and the next attempt resumes
from the newest step; real damage is skipped, told and quarantined, and the steps it cost are
counted; a body changed in flight is never committed, with botocore's own checksums off.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.checkpoint.s3 import S3Storage
from elastrain_trainer.events import parse_line
from elastrain_trainer.ports import free_port
from elastrain_trainer.summary import summarize

from .conftest import make_s3_storage, s3_env, subprocess_env, trainer_env
from .fault_proxy import Fault, FaultProxy

pytestmark = [pytest.mark.s3, pytest.mark.torchrun, pytest.mark.timeout(420)]


class Run:
    """One torchrun of the built-in trainer (`nproc` ranks); its records, output and exit (its
    whole output is kept under `Run.logs` for a post-mortem)."""

    logs = Path("/tmp/elastrain-test-runs")

    def __init__(self, env: dict[str, str], nproc: int) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "elastrain_trainer"]
        self.proc = subprocess.Popen(cmd, env=subprocess_env(env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.records: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                if (record := parse_line(line)) is not None:
                    self.records.append(record)
                self._cond.notify_all()

    def wait_for(self, event: str, timeout: float = 180) -> dict[str, Any]:
        with self._cond:
            assert self._cond.wait_for(lambda: self.events(event) or self.proc.poll() is not None,
                                       timeout), f"no {event} in {timeout} s"
            found = self.events(event)
            assert found, f"exited {self.proc.poll()} before {event}:\n{self.output[-3000:]}"
            return found[0]

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            Run.logs.mkdir(parents=True, exist_ok=True)
            (Run.logs / f"run-{self.proc.pid}.log").write_text(self.output)

    def events(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]

    @property
    def output(self) -> str:
        return "".join(self.lines)


@pytest.fixture
def proxy(s3_credentials: Any) -> Iterator[FaultProxy]:
    host, port = s3_credentials.endpoint_url.removeprefix("http://").split(":")
    with FaultProxy(host, int(port)) as p:
        yield p


@pytest.fixture
def storage(s3_credentials: Any) -> Iterator[S3Storage]:
    store = make_s3_storage(s3_credentials)
    yield store
    store.delete(store.list())


def job_env(tmp_path: Path, s3: Any, storage: S3Storage, proxy: FaultProxy,
            **overrides: str) -> dict[str, str]:
    settings = {"checkpoint_uri": storage.uri, "checkpoint_endpoint": proxy.endpoint,
                "checkpoint_interval_steps": "4", "checkpoint_keep": "5",
                "checkpoint_async": "0", **overrides}
    return {**trainer_env(tmp_path, **settings), **s3_env(s3)}


def switch_after_first(proxy: FaultProxy, counter: str, seconds: float,
                       then: Fault) -> threading.Thread:
    """Set `then` `seconds` after the proxy first counts `counter` (the fault met the load, not
    the start-up: importing torch in 4 ranks on 2 cores takes a while), within 240 s."""
    def run() -> None:
        deadline = time.monotonic() + 240
        while proxy.stats[counter] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(seconds)
        proxy.set(then)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def committed_objects(storage: S3Storage) -> dict[str, bytes]:
    catalog = scan(storage)
    return {k: storage.read(k) for c in catalog.commits for k in storage.list(c.dir + "/")}


def train_first(env: dict[str, str], storage: S3Storage, steps: list[int]) -> dict[str, bytes]:
    """A first run that commits `steps`; what it committed, byte for byte."""
    first = Run(env, nproc=2)
    assert first.finish() == 0, first.output[-3000:]
    assert [c.step for c in scan(storage).commits] == steps
    return committed_objects(storage)


def assert_resumed_from_newest(run: Run, step: int) -> None:
    assert [r["step"] for r in run.events("resumed")] == [step], run.output[-3000:]
    assert not run.events("checkpoint_skipped") and not run.events("fresh_start")
    assert not run.events("checkpoint_fallback")


def test_resume_through_resets_waits_for_the_store_and_loads_the_newest(
        tmp_path: Path, s3_credentials: Any, storage: S3Storage, proxy: FaultProxy) -> None:
    env = job_env(tmp_path, s3_credentials, storage, proxy, steps="12",
                  checkpoint_wait_seconds="180")
    before = train_first(env, storage, [4, 8, 12])
    # Every response larger than 16 KiB (shards) is cut off part-way, for 40 s.
    proxy.set(Fault(reset_response_over=16384))
    switch_after_first(proxy, "resets", 40, Fault())
    second = Run({**env, "ELASTRAIN_STEPS": "16"}, nproc=2)
    assert second.finish() == 0, second.output[-3000:]
    assert_resumed_from_newest(second, 12)
    assert proxy.stats["resets"] > 0
    assert second.events("checkpoint_read_failed"), "the load never met the fault"
    assert second.events("checkpoint_store_recovered")
    assert [r["step"] for r in second.events("step")] == [13, 14, 15, 16]
    # Every rank loaded step 12: a rank that started elsewhere would have trained other steps
    # or hung in a collective; and nothing committed before was touched.
    after = committed_objects(storage)
    assert all(after[k] == v for k, v in before.items())
    assert [c.step for c in scan(storage).commits] == [4, 8, 12, 16]


def test_a_fault_that_outlasts_the_wait_stops_with_the_reason_then_resumes_newest(
        tmp_path: Path, s3_credentials: Any, storage: S3Storage, proxy: FaultProxy) -> None:
    env = job_env(tmp_path, s3_credentials, storage, proxy, steps="8",
                  checkpoint_wait_seconds="6")
    before = train_first(env, storage, [4, 8])
    proxy.set(Fault(reset_response_over=16384))
    stopped = Run({**env, "ELASTRAIN_STEPS": "12"}, nproc=2)
    assert stopped.finish() != 0
    assert "checkpoint store still failing after 6 s, not resumed" in stopped.output
    assert f"{storage.uri}/step-00000008" in stopped.output  # the store and the object
    assert not stopped.events("step") and not stopped.events("fresh_start")
    assert not stopped.events("checkpoint_skipped")
    assert committed_objects(storage) == before
    proxy.set(Fault())
    resumed = Run({**env, "ELASTRAIN_STEPS": "12"}, nproc=2)
    assert resumed.finish() == 0, resumed.output[-3000:]
    assert_resumed_from_newest(resumed, 8)


def test_four_workers_resume_at_once_through_slowdowns(
        tmp_path: Path, s3_credentials: Any, storage: S3Storage, proxy: FaultProxy) -> None:
    env = job_env(tmp_path, s3_credentials, storage, proxy, steps="8",
                  checkpoint_wait_seconds="180")
    train_first(env, storage, [4, 8])
    # Every checkpoint read is throttled for 15 s (the location check is not), then every
    # other one for the rest of the run.
    proxy.set(Fault(slowdown_every=1, path=r"step-0"))
    switch_after_first(proxy, "slowdowns", 15, Fault(slowdown_every=2, path=r"step-0"))
    run = Run({**env, "ELASTRAIN_STEPS": "12"}, nproc=4)
    assert run.finish() == 0, run.output[-3000:]
    assert_resumed_from_newest(run, 8)
    assert proxy.stats["slowdowns"] > 0
    assert run.events("checkpoint_read_failed")
    assert {r["world_size"] for r in run.events("step")} == {4}
    assert [r["step"] for r in run.events("step")] == [9, 10, 11, 12]


def progress_of(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5) as response:
        doc: dict[str, Any] = json.loads(response.read())
        return doc


def test_a_damaged_checkpoint_is_skipped_told_counted_and_kept(
        tmp_path: Path, s3_credentials: Any, storage: S3Storage, proxy: FaultProxy) -> None:
    env = job_env(tmp_path, s3_credentials, storage, proxy, steps="12",
                  checkpoint_keep="3")
    train_first(env, storage, [4, 8, 12])
    shard = next(k for k in storage.list("step-00000012/") if k.endswith(".distcp"))
    data = bytearray(storage.read(shard))
    data[len(data) // 2] ^= 0xFF
    storage.write(shard, data)
    damaged = {k: storage.read(k) for k in storage.list("step-00000012/")}
    port = free_port()
    run = Run({**env, "ELASTRAIN_STEPS": "20", "ELASTRAIN_METRICS_PORT": str(port),
               "ELASTRAIN_STEP_SLEEP_SECONDS": "0.3"}, nproc=2)
    fallback = run.wait_for("checkpoint_fallback")
    report = progress_of(port)["checkpointFallback"]
    assert run.finish() == 0, run.output[-3000:]
    assert (fallback["skipped_step"], fallback["loaded_step"], fallback["steps_lost"]) == (12, 8, 4)
    assert "sha256" in fallback["reason"] and fallback["quarantined"] is True
    assert report["skippedStep"] == 12 and report["loadedStep"] == 8
    assert report["stepsLost"] == 4 and report["skippedUri"] == f"{storage.uri}/step-00000012"
    assert [r["step"] for r in run.events("resumed")] == [8]
    assert summarize(run.records).steps_lost == 4
    # Kept as it was (plus its QUARANTINED marker), never overwritten by the new step 12.
    assert {k: storage.read(k) for k in damaged} == damaged
    assert storage.exists(f"step-00000012/{mf.QUARANTINED}")
    catalog = scan(storage)
    assert [c.dir for c in catalog.commits][-3:] == ["step-00000012.2", "step-00000016",
                                                     "step-00000020"]
    assert storage.read(mf.LATEST) == b"step-00000020"
    # A restart resumes the newest work and does not report the old damage again.
    again = Run({**env, "ELASTRAIN_STEPS": "24"}, nproc=2)
    assert again.finish() == 0, again.output[-3000:]
    assert_resumed_from_newest(again, 20)


@pytest.mark.usefixtures("one_rank_group")
def test_a_body_changed_in_flight_is_never_committed_with_sdk_checksums_off(
        s3_credentials: Any, storage: S3Storage, proxy: FaultProxy,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Common with S3-compatible stores: botocore computes no checksum of its own.
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    flaky = S3Storage(storage.uri, endpoint_url=proxy.endpoint, part_bytes=5 << 20)
    state = {"model": {"w": torch.randn(1024, 1024)}}  # 4 MiB: one PutObject
    big = {"model": {"w": torch.randn(3 << 20)}}  # 12 MiB: a multipart upload
    for name, payload in (("one object", state), ("multipart", big)):
        flipped = proxy.stats["flipped"]
        proxy.set(Fault(flip_request_byte=1, path=r"\.distcp"))
        manager = CheckpointManager(flaky, async_save=False)
        manager.save(SaveRequest(1, payload, {}))
        assert proxy.stats["flipped"] == flipped + 1, name
        assert manager.failed_saves == 1, name
        assert scan(storage).commits == (), name
        assert not storage.exists(mf.LATEST), name
        proxy.set(Fault())
        manager.save(SaveRequest(2, payload, {}))
        assert manager.failed_saves == 1, name
        into = {"model": {"w": torch.zeros_like(payload["model"]["w"])}}
        assert CheckpointManager(storage, async_save=False).load(into) is not None
        assert torch.equal(into["model"]["w"], payload["model"]["w"]), name
        storage.delete(storage.list())  # the next case starts from an empty root
