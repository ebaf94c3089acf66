"""The operator killed at random moments, and two replicas under kopf peering.

Counting is exact only if an operator restart at any point neither loses nor repeats a count:
the tests kill the operator with SIGKILL while workers are being lost, replaced and scaled, and
then compare the job's counters with the losses the test itself caused.
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.conftest import free_port, scrape
from tests.integration.operator.conftest import Cluster, Operator, wait_for

pytestmark = pytest.mark.cluster
KILLS = 10


def live_indexes(cluster: Cluster) -> list[int]:
    return sorted(int(p["metadata"]["labels"]["elastrain.dev/worker-index"])
                  for p in cluster.pods().values())


def converged(cluster: Cluster, desired: int, gone: set[str]) -> bool:
    pods = cluster.pods()
    return live_indexes(cluster) == list(range(desired)) and not gone & set(pods)


def assert_exact(cluster: Cluster, desired: int, expected: dict[str, int]) -> None:
    wait_for("counters and workers settled", lambda: converged(cluster, desired, set())
             and {k: cluster.status().get(k) for k in expected} == expected, timeout=60)
    slots = {s["index"]: s["attempt"] for s in cluster.status()["slots"]}
    everything = cluster.pods(live=False)
    for name, pod in everything.items():
        labels = pod["metadata"]["labels"]
        assert pod["metadata"]["ownerReferences"], f"{name} is orphaned"
        index, attempt = int(labels["elastrain.dev/worker-index"]), int(
            labels["elastrain.dev/attempt"])
        if not pod["metadata"].get("deletionTimestamp"):
            assert slots[index] == attempt, f"{name} is not its slot's current attempt"


def assert_no_traceback(*ops: Operator) -> None:
    """Nothing an operator logged may be a traceback: a crash kopf survived is still a crash."""
    for op in ops:
        logs = op.logs()
        at = logs.find("Traceback (most recent call last)")
        context = logs[max(0, at - 2000):at + 4000]
        assert at < 0, f"operator {op.log_dir.name} logged a traceback:\n{context}"


class Chaos(threading.Thread):
    """SIGKILL the operator and start it again, KILLS times, at random moments.

    Before each kill it checks that the operator is still running: one that exited on its own
    crashed, and a test that only ever restarts it would never notice."""

    def __init__(self, op: Operator, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.op, self.rng = op, rng
        self.kills = 0
        self.crashed: str | None = None
        self.lock = threading.Lock()

    def run(self) -> None:
        while self.kills < KILLS:
            time.sleep(self.rng.uniform(0.5, 3.0))
            with self.lock:
                if not self.alive():
                    return
                self.op.kill()
                self.kills += 1
                if self.rng.random() < 0.3:
                    time.sleep(self.rng.uniform(0.5, 2.0))  # sometimes stay down a while
                self.op.start()

    def alive(self) -> bool:
        code = self.op.proc.poll() if self.op.proc is not None else "never started"
        if code is not None and self.crashed is None:
            self.crashed = (f"the operator (start {self.op.starts}) exited on its own with "
                            f"{code} before kill {self.kills + 1}")
        return self.crashed is None

    def check(self) -> None:
        """Fail the test at once if the operator crashed (waits call this while they poll)."""
        if self.crashed is not None:
            pytest.fail(f"{self.crashed}; its log:\n{self.op.logs()[-6000:]}")


def test_sigkill_at_random_points_keeps_counts_exact(
        cluster: Cluster, operator_factory: Callable[..., Operator]) -> None:
    seed = int(os.environ.get("ELASTRAIN_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"chaos seed {seed}")
    op = operator_factory()
    op.start()
    desired = 3
    cluster.create_job(replicas=desired, minReplicas=1, maxReplicas=5,
                       restartPolicy={"maxRestarts": 1000, "backoffSeconds": 0})
    wait_for("first workers", lambda: converged(cluster, desired, set()), timeout=60)
    expected = {"preemptions": 0, "restarts": 0}
    chaos = Chaos(op, rng)
    chaos.start()
    actions = 0
    while actions < 14 or chaos.is_alive():
        cluster.run_all()
        victim = rng.choice(sorted(cluster.pods()))
        action = rng.choice(["preempt", "fail", "evict", "delete", "scale"])
        gone = {victim}
        if action == "preempt":
            cluster.exit(victim, 143, disruption=rng.choice(
                ["PreemptionByScheduler", "TerminationByKubelet", "DeletionByTaintManager"]))
            expected["preemptions"] += 1
        elif action == "fail":
            cluster.exit(victim, rng.choice([1, 137]))
            expected["restarts"] += 1
        elif action == "evict":
            cluster.evict(victim)
            expected["preemptions"] += 1
        elif action == "delete":
            cluster.delete_pod(victim)
            expected["preemptions"] += 1
        else:
            desired = rng.choice([d for d in range(1, 6) if d != desired])
            cluster.kubectl("scale", "tj/demo", f"--replicas={desired}")
            gone = set()
        actions += 1
        settled = functools.partial(converged, cluster, desired, gone)

        def handled(settled: Callable[[], bool] = settled) -> bool:
            chaos.check()
            return settled()

        wait_for(f"action {actions} ({action} {victim}) handled", handled, timeout=60)
    chaos.join()
    chaos.check()
    assert chaos.kills == KILLS
    assert_exact(cluster, desired, expected)
    # The last replacement may have left the job below minReplicas (Restarting) until it runs.
    cluster.run_all()
    wait_for("phase Running once the replacements run",
             lambda: cluster.status()["phase"] == "Running", timeout=30)
    with chaos.lock:
        assert chaos.alive(), chaos.crashed
    assert_no_traceback(op)


RECONCILES = "elastrain_operator_reconcile_duration_seconds_count"  # every reconcile, any result


def reconciles(port: int) -> float:
    """How many reconciles the replica serving /metrics on `port` ran; fails if it is silent
    (an unlabelled histogram's count is exported from the start, so 0 means 0, not absent)."""
    samples = wait_for(f"/metrics on port {port}", lambda: scrape(port), timeout=10)
    return samples[RECONCILES]


def peers(cluster: Cluster) -> dict[str, Any]:
    """The replicas' keep-alives in the KopfPeering object: peer id -> {priority, lastseen...}."""
    peering = cluster.kube.get(
        f"/apis/kopf.dev/v1/namespaces/{cluster.ns}/kopfpeerings/elastrain") or {}
    return dict(peering.get("status") or {})


def test_two_replicas_only_the_higher_priority_acts(
        cluster: Cluster, peering_crds: Any, operator_factory: Callable[..., Operator],
        monkeypatch: pytest.MonkeyPatch) -> None:
    common = ("--peering", "elastrain", "--peering-lifetime", "8")
    ports = {"high": free_port(), "low": free_port()}
    ops = {}
    for name, priority in (("high", 100), ("low", 50)):
        monkeypatch.setenv("POD_ID", f"replica-{name}")  # kopf's peer id in the peering status
        ops[name] = operator_factory(*common, "--priority", str(priority),
                                     "--metrics-port", str(ports[name]), name=name)
        ops[name].start()
    high, low = ops["high"], ops["low"]
    wait_for("both replicas in the peering object", lambda: {
        peer: entry["priority"] for peer, entry in peers(cluster).items()} == {
        "replica-high": 100, "replica-low": 50})
    wait_for("the high-priority replica is active", lambda: "Resuming operations" in high.logs())
    cluster.create_job(replicas=2, restartPolicy={"backoffSeconds": 0})
    wait_for("workers", lambda: converged(cluster, 2, set()), timeout=60)
    cluster.run_all()
    cluster.exit("demo-worker-0-0", 143, disruption="PreemptionByScheduler")
    wait_for("replacement", lambda: converged(cluster, 2, {"demo-worker-0-0"}), timeout=60)
    assert_exact(cluster, 2, {"preemptions": 1, "restarts": 0})
    assert reconciles(ports["high"]) >= 2
    assert reconciles(ports["low"]) == 0, "the paused replica acted"
    low_created = scrape(ports["low"]) or {}
    assert low_created["elastrain_operator_workers_created_total"] == 0

    # The active replica dies without a goodbye: the other takes over once its record expires.
    high.kill()
    wait_for("the low-priority replica reconciles", lambda: reconciles(ports["low"]) > 0,
             timeout=60)
    cluster.run_all()
    cluster.exit("demo-worker-1-0", 1)
    wait_for("replacement by the survivor",
             lambda: converged(cluster, 2, {"demo-worker-1-0"}), timeout=60)
    assert_exact(cluster, 2, {"preemptions": 1, "restarts": 1})
    survivor = scrape(ports["low"]) or {}
    assert survivor["elastrain_operator_workers_created_total"] == 1
    assert low.proc is not None and low.proc.poll() is None
    assert_no_traceback(high, low)
