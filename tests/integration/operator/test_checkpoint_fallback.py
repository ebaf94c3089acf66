"""A resume that skipped a damaged checkpoint reaches the TrainingJob: the operator, on the real
apiserver, polls /progress through a worker pod whose status points at 127.0.0.1 and keeps the
fallback in status.checkpointFallback, the CheckpointFallback condition, one Warning event per
fallback and `elastrain describe`.

The /progress document comes from `StandInProgress`, a stand-in for the trainer's /progress
endpoint serving exactly the contract's `checkpointFallback` (policy/fallback.py), so each
phase (a fallback, the next start's null, a newer fallback) is chosen by the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.operator.conftest import Cluster, Operator, wait_for
from tests.integration.operator.test_cli_describe import describe
from tests.stand_in_progress import StandInProgress

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
KIND, REASON = "CheckpointFallback", "DamagedCheckpointSkipped"
WHY = "checksum mismatch of __0_0.distcp: sha256 in the manifest 0f3a, read 9c1e"


class FallbackProgress(StandInProgress):
    """The stand-in serving the contract's `checkpointFallback` phase by phase."""

    def serve(self, step: int, fallback: dict[str, Any] | None, *, absent: bool = False) -> None:
        doc: dict[str, Any] = {"step": step, "totalSteps": 1000, "loss": 1.0, "worldSize": 1,
                               "lastCheckpoint": None}
        if not absent:
            doc["checkpointFallback"] = fallback
        self.document = doc


@pytest.fixture
def stand_in() -> Iterator[FallbackProgress]:
    server = FallbackProgress()
    yield server
    server.close()


def fallback(skipped: int, loaded: int | None, at: str) -> dict[str, Any]:
    return {"skippedStep": skipped, "skippedUri": f"s3://b/job/step-{skipped:08d}",
            "reason": WHY, "loadedStep": loaded,
            "loadedUri": None if loaded is None else f"s3://b/job/step-{loaded:08d}",
            "stepsLost": skipped - (loaded or 0), "quarantined": True, "time": at}


def polled(cluster: Cluster, stand_in: FallbackProgress, *steps: int) -> None:
    """Serve each step in turn until status shows it: the round that wrote the last one started
    after the previous one's round ended, events included (one round at a time per job)."""
    doc = stand_in.document
    for step in steps:
        stand_in.document = {**doc, "step": step}
        wait_for(f"status.progress.step == {step}", lambda: (
            cluster.status().get("progress", {}).get("step") == stand_in.document["step"]),
            timeout=30)


def condition(cluster: Cluster) -> dict[str, Any]:
    return cluster.condition(KIND)


def test_a_fallback_is_told_once_and_kept_until_a_newer_one(
        cluster: Cluster, operator: Operator, stand_in: FallbackProgress) -> None:
    stand_in.serve(5, None, absent=True)  # an older trainer: no field at all
    cluster.create_job(replicas=1, metricsPort=stand_in.port)
    cluster.wait_workers(["demo-worker-0-0"])
    cluster.run_all()
    polled(cluster, stand_in, 6)
    assert condition(cluster) == {} and "checkpointFallback" not in cluster.status()

    first = fallback(12, 8, "2026-01-01T00:00:30Z")
    stand_in.serve(9, first)
    cond = wait_for("CheckpointFallback=True", lambda: (
        c if (c := condition(cluster)).get("status") == "True" else None), timeout=30)
    assert cond["reason"] == REASON
    assert cond["message"] == (
        f"at 2026-01-01T00:00:30+00:00 skipped the damaged checkpoint of step 12 "
        f"(s3://b/job/step-00000012): {WHY}; resumed from step 8 (s3://b/job/step-00000008); "
        "4 step(s) lost; quarantined (kept for a post-mortem, never loaded again)")
    assert cluster.status()["checkpointFallback"] == first
    (event,) = wait_for("the Warning event", lambda: cluster.events(REASON))
    assert event["type"] == "Warning"
    assert event["message"] == f"CheckpointFallback=True: {cond['message']}"

    # The same fallback polled again and again, and read by a restarted operator: still one.
    polls = stand_in.polls
    polled(cluster, stand_in, 10, 11)
    operator.kill()
    operator.start()
    polled(cluster, stand_in, 12, 13)
    assert stand_in.polls >= polls + 4
    assert len(cluster.events(REASON)) == 1

    # The next start resumed normally (null): the lost work stays on record.
    stand_in.serve(14, None)
    polled(cluster, stand_in, 15, 16)
    assert cluster.status()["checkpointFallback"] == first
    assert condition(cluster) == cond
    assert len(cluster.events(REASON)) == 1

    # A newer fallback with the condition already True: its own event, a new message.
    second = fallback(20, None, "2026-01-01T00:10:00Z")
    stand_in.serve(2, second)
    newer = wait_for("the newer fallback's message", lambda: (
        c if "step 20" in (c := condition(cluster)).get("message", "") else None), timeout=30)
    assert (newer["status"], newer["lastTransitionTime"]) == ("True", cond["lastTransitionTime"])
    assert "no usable checkpoint left, started from step 0; 20 step(s) lost" in newer["message"]
    # Status leaves out what is null (loadedStep, loadedUri: started from step 0).
    assert cluster.status()["checkpointFallback"] == {k: v for k, v in second.items()
                                                      if v is not None}
    events = wait_for("the second Warning event", lambda: (
        e if len(e := cluster.events(REASON)) == 2 else None), timeout=30)
    assert sum("step 20" in e["message"] for e in events) == 1
    polled(cluster, stand_in, 3, 4)
    assert len(cluster.events(REASON)) == 2

    shown = describe(cluster, "demo")
    assert shown.returncode == 0, shown.stderr
    assert f"Checkpoint fallback: {newer['message']}\n" in shown.stdout
