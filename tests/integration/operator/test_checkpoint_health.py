"""Checkpoint failures reach the TrainingJob: a real trainer process (`python -m
elastrain_trainer`, a world of one) checkpoints to the real MinIO and serves /progress on a
loopback port; the operator, on the real apiserver, polls it through a worker pod whose status
points at 127.0.0.1; the tests read the job's conditions, events and printer columns.

Wrong credentials and a missing bucket fail at start, before any step (the wrong key under the
launcher the operator gives worker pods, whose termination message the operator then quotes as
a kubelet would hand it over); a store that goes away
(a TCP proxy in front of MinIO, cut and healed) shows within a minute and clears when it is back,
both mid-training and at start.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.events import parse_line
from elastrain_trainer.ports import free_port
from tests.integration.operator.conftest import Cluster, Operator, wait_for
from tests.integration.trainer.conftest import s3_env, subprocess_env, trainer_env
from tests.integration.trainer.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.cluster, pytest.mark.s3, pytest.mark.timeout(300)]
FAILING = "CheckpointsFailing"


class Trainer:
    """One trainer process; its structured records, stderr and exit code."""

    def __init__(self, env: dict[str, str], log: Path, *, launcher: bool = False) -> None:
        self.port = int(env["ELASTRAIN_METRICS_PORT"])
        self.records: list[dict[str, Any]] = []
        self.stderr = log
        # The launcher writes its crash reason there only if the file exists (as in a pod).
        self.termination_log = log.with_suffix(".termination-log")
        self.termination_log.touch()
        command = [sys.executable, "-m", "elastrain_trainer"]
        if launcher:
            command[2:2] = ["elastrain_trainer.launch", "--standalone", "--nnodes=1",
                            "--nproc-per-node=1", "-m"]
        env = {**env, "ELASTRAIN_TERMINATION_LOG": str(self.termination_log)}
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(command, env=subprocess_env(env),
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        self.started = time.monotonic()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if (record := parse_line(line)) is not None:
                self.records.append(record)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in list(self.records) if r["event"] == kind]

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.port}/metrics"
        return str(urllib.request.urlopen(url, timeout=5).read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        # Shown with a failed test's captured output: what the trainer said, not just a timeout.
        tail = self.stderr.read_text(errors="replace").splitlines()[-40:]
        print(f"--- trainer (exit {self.proc.returncode}) stderr tail ---", *tail, sep="\n")
        # And its records but the steps: a metrics_unavailable (port taken) says why nobody
        # could read its /progress.
        print("--- trainer records ---",
              *[r for r in list(self.records) if r["event"] != "step"][-20:], sep="\n")


def start_job(cluster: Cluster, port: int) -> None:
    """A one-worker job whose pod runs 'at' 127.0.0.1, so the operator polls the trainer."""
    cluster.create_job(replicas=1, metricsPort=port)
    cluster.wait_workers(["demo-worker-0-0"])
    cluster.run_all()


def condition_is(cluster: Cluster, status: str, reason: str) -> dict[str, Any] | None:
    cond = cluster.condition(FAILING)
    return cond if (cond.get("status"), cond.get("reason")) == (status, reason) else None


def failed_saves_column(cluster: Cluster) -> str:
    """The FAILED SAVES column of `kubectl get tj` (cut at the header's offsets: columns
    without a value are blank)."""
    header, row = cluster.kubectl("get", "tj", "demo").stdout.splitlines()[:2]
    start = header.index("FAILED SAVES")
    return row[start:header.index("AGE", start)].strip()


@pytest.mark.parametrize("fault", ["wrong-secret-key", "missing-bucket"])
def test_an_unusable_location_fails_at_start_and_the_job_says_why(
        cluster: Cluster, operator: Operator, s3: Any, tmp_path: Path, fault: str) -> None:
    port = free_port()
    bucket = s3.bucket if fault == "wrong-secret-key" else f"missing-{uuid.uuid4().hex[:8]}"
    uri = f"s3://{bucket}/health/{uuid.uuid4().hex[:8]}"
    env = {**trainer_env(tmp_path, metrics_port=str(port), checkpoint_uri=uri,
                         checkpoint_endpoint=s3.endpoint_url), **s3_env(s3)}
    if fault == "wrong-secret-key":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret-key"
        expected = "SignatureDoesNotMatch: the secret access key does not match the access key"
    else:
        expected = f"NoSuchBucket: bucket '{bucket}' does not exist at this endpoint"
    launcher = fault == "wrong-secret-key"
    start_job(cluster, port)
    trainer = Trainer(env, tmp_path / "trainer.err", launcher=launcher)
    try:
        cond = wait_for("CheckpointsFailing=True", lambda: condition_is(
            cluster, "True", "CheckpointSaveFailed"), timeout=60)
        seconds = time.monotonic() - trainer.started
        assert trainer.proc.wait(timeout=60) == 1
    finally:
        trainer.stop()
        # What the operator had to go on, shown with a failed test: was the pod Ready (polled)?
        print("--- job status ---", cluster.status(), "--- pod status ---",
              {name: pod.get("status") for name, pod in cluster.pods().items()}, sep="\n")
    print(f"{fault}: CheckpointsFailing {seconds:.1f} s after the trainer started")
    assert seconds < 60
    # Exactly what is wrong: the operation and key, the endpoint and the credential source.
    assert expected in cond["message"], cond
    assert (f"(on list {uri}/.elastrain-check; endpoint {s3.endpoint_url}, access key "
            f"****{s3.access_key[-4:]} from environment variables "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)") in cond["message"]
    assert "not-the-secret-key" not in cond["message"]
    # The trainer never trained, and its exit says the same as the condition.
    assert not trainer.events("step")
    said = ("CheckpointLocationError: checkpoint location unusable, training not started: "
            + expected)
    assert said in trainer.stderr.read_text()
    (event,) = wait_for("the Warning event", lambda: cluster.events("CheckpointSaveFailed"))
    assert event["type"] == "Warning" and expected in event["message"]
    assert failed_saves_column(cluster) == "1"
    # The pod ends as the trainer did. The operator's round on that exit comes after every poll
    # and round before it (a job's rounds run one at a time) and still sees the failing
    # condition: if any of them posted the event again, it would be there by now.
    reason = trainer.termination_log.read_text()
    if launcher:
        # The pod fails with the launcher's one-line reason; the operator counts and quotes it.
        assert reason.startswith(f"elastrain: worker crashed: rank 0, exit code 1: {said}")
    cluster.exit("demo-worker-0-0", 1, message=reason)
    (failed,) = wait_for("WorkerFailed", lambda: cluster.events("WorkerFailed"))
    assert len(cluster.events("CheckpointSaveFailed")) == 1
    assert cluster.status()["restarts"] == 1
    if launcher:
        assert "CheckpointLocationError: checkpoint location unusable, training not started: " \
               "SignatureDoesNotMatch: the secret access key does not match" in failed["message"]


def outage_env(s3: Any, tmp_path: Path, proxy: TcpProxy, port: int) -> dict[str, str]:
    uri = f"s3://{s3.bucket}/health/{uuid.uuid4().hex[:8]}"
    return {**trainer_env(tmp_path, metrics_port=str(port), checkpoint_uri=uri,
                          checkpoint_endpoint=proxy.endpoint, steps="100000",
                          checkpoint_interval_steps="5", step_sleep_seconds="0.1"),
            **s3_env(s3)}


def minio_proxy(s3: Any) -> TcpProxy:
    host, port = s3.endpoint_url.removeprefix("http://").split(":")
    return TcpProxy(host, int(port)).start()


def test_a_store_down_for_30_s_mid_training_shows_within_a_minute_and_clears(
        cluster: Cluster, operator: Operator, s3: Any, tmp_path: Path) -> None:
    port, proxy = free_port(), minio_proxy(s3)
    start_job(cluster, port)
    trainer = Trainer(outage_env(s3, tmp_path, proxy, port), tmp_path / "trainer.err")
    try:
        wait_for("a committed checkpoint, healthy", lambda: condition_is(
            cluster, "False", "CheckpointsHealthy") and cluster.status().get("lastCheckpoint"),
            timeout=90)
        assert failed_saves_column(cluster) == "0"
        committed_before_cut = cluster.status()["lastCheckpoint"]["step"]
        proxy.cut()
        cut_at = time.monotonic()
        cond = wait_for("CheckpointsFailing=True", lambda: condition_is(
            cluster, "True", "CheckpointSaveFailed"), timeout=60)
        seconds = time.monotonic() - cut_at
        print(f"store cut: CheckpointsFailing {seconds:.1f} s later")
        assert seconds < 60
        assert "no answer from the endpoint" in cond["message"]
        assert f"endpoint {proxy.endpoint}" in cond["message"]
        text = trainer.metrics()
        assert 'elastrain_trainer_checkpoint_failures_total{kind="unreachable"}' in text
        assert "elastrain_trainer_checkpoint_consecutive_failures 0.0" not in text
        time.sleep(max(0.0, 30 - (time.monotonic() - cut_at)))
        proxy.heal()
        cleared = wait_for("CheckpointsFailing=False again", lambda: condition_is(
            cluster, "False", "CheckpointsHealthy"), timeout=90)
        assert trainer.proc.poll() is None  # trained through the outage
        assert "elastrain_trainer_checkpoint_consecutive_failures 0.0" in trainer.metrics()
    finally:
        trainer.stop()
        proxy.cut()
    assert "no answer" not in cleared["message"]
    # A save that started during the outage may be the one that commits once the store is
    # back (botocore retries), so the new commit is judged against the last one before the cut.
    assert cluster.status()["lastCheckpoint"]["step"] > committed_before_cut
    (warning,) = cluster.events("CheckpointSaveFailed")
    (normal,) = wait_for("the Normal event", lambda: cluster.events("CheckpointsHealthy"))
    assert (warning["type"], normal["type"]) == ("Warning", "Normal")


def test_a_store_down_at_start_is_waited_for_and_training_starts_when_it_is_back(
        cluster: Cluster, operator: Operator, s3: Any, tmp_path: Path) -> None:
    port, proxy = free_port(), minio_proxy(s3)
    proxy.cut()
    start_job(cluster, port)
    trainer = Trainer(outage_env(s3, tmp_path, proxy, port), tmp_path / "trainer.err")
    try:
        cond = wait_for("CheckpointsFailing=True", lambda: condition_is(
            cluster, "True", "CheckpointSaveFailed"), timeout=60)
        assert cond["message"].count("EndpointConnectionError: no answer from the endpoint "
                                     "(on list s3://") == 1, cond
        # Two retries after the first failed check (2 s, then 4 s later): waiting, not failing.
        checks = wait_for("three failed checks", lambda: (
            f if len(f := trainer.events("checkpoint_location_failed")) >= 3 else None),
            timeout=60)
        assert all(c["retry_in_s"] is not None for c in checks), checks
        assert trainer.proc.poll() is None and not trainer.events("step")
        proxy.heal()
        wait_for("CheckpointsFailing=False", lambda: condition_is(
            cluster, "False", "CheckpointsHealthy"), timeout=60)
        wait_for("training", lambda: trainer.events("step"), timeout=60)
    finally:
        trainer.stop()
        proxy.cut()
    (ok,) = trainer.events("checkpoint_location_ok")
    assert ok["attempts"] > 1
    assert len(cluster.events("CheckpointSaveFailed")) == 1


def test_a_resume_past_a_damaged_checkpoint_is_told_on_the_job(
        cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    """The real trainer (not a stand-in): checkpoint 12 is damaged on disk, the resume falls
    back to 8, and the job says so: condition, status (steps lost), one Warning event."""
    ckpt = tmp_path / "ckpt"
    first = trainer_env(tmp_path, steps="12", checkpoint_interval_steps="4",
                        checkpoint_async="0")
    done = subprocess.run([sys.executable, "-m", "elastrain_trainer"], env=subprocess_env(first),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    shard = next((ckpt / "step-00000012").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    port = free_port()
    start_job(cluster, port)
    trainer = Trainer({**first, "ELASTRAIN_STEPS": "100000", "ELASTRAIN_METRICS_PORT": str(port),
                       "ELASTRAIN_STEP_SLEEP_SECONDS": "0.1"}, tmp_path / "trainer.err")
    try:
        cond = wait_for("CheckpointFallback=True", lambda: (
            c if (c := cluster.condition("CheckpointFallback")).get("status") == "True"
            else None), timeout=90)
        status = cluster.status()["checkpointFallback"]
        (event,) = wait_for("the Warning event",
                            lambda: cluster.events("DamagedCheckpointSkipped"))
        # More polls (the operator keeps reading the same report): still one event.
        polled_at = cluster.status()["progress"]["step"]
        wait_for("more polls", lambda: cluster.status()["progress"]["step"] >= polled_at + 20,
                 timeout=60)
        assert len(cluster.events("DamagedCheckpointSkipped")) == 1
    finally:
        trainer.stop()
    assert (status["skippedStep"], status["loadedStep"], status["stepsLost"]) == (12, 8, 4)
    assert status["quarantined"] is True and "sha256" in status["reason"]
    assert status["skippedUri"] == f"file://{ckpt}/step-00000012"
    assert "step 12" in cond["message"] and "4 step(s) lost" in cond["message"]
    assert event["type"] == "Warning" and "step 12" in event["message"]
    assert (ckpt / "step-00000012" / "QUARANTINED").exists()
