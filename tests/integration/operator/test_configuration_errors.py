"""A worker's configuration error fails the job at once on the real apiserver (issue 18 item 2).

The launcher ends such a worker with `elastrain: configuration error: <the trainer's message>`
in its termination message: the operator neither counts nor replaces it, and the Failed
condition, its event and `elastrain describe` quote the message. A plain crash still restarts
after its backoff (the control).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.operator.conftest import Cluster, Operator, wait_for

pytestmark = pytest.mark.cluster
MESSAGE = ("file:///data/train.bin: bad magic 1 in the llm.c header (expected 20240520 or "
           "20240801)")
TERMINATION = f"[rank0] loading the dataset\nelastrain: configuration error: {MESSAGE}\n"
POLICY = {"maxRestarts": 3, "backoffSeconds": 60, "maxBackoffSeconds": 60}


def running(cluster: Cluster, names: list[str]) -> None:
    cluster.wait_workers(names)
    cluster.run_all()
    wait_for("phase Running", lambda: cluster.status().get("phase") == "Running")


def test_a_configuration_error_fails_the_job_at_once(cluster: Cluster,
                                                     operator: Operator) -> None:
    cluster.create_job(replicas=2, restartPolicy=POLICY)
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-0-0", 78, message=TERMINATION)
    wait_for("job failed", lambda: cluster.status().get("phase") == "Failed")
    status = cluster.status()
    assert status["restarts"] == 0 and not status.get("restartBackoffUntil"), status
    failed = cluster.condition("Failed")
    assert failed["reason"] == "ConfigurationError" and MESSAGE in failed["message"], failed
    events = wait_for("ConfigurationError events", lambda: (
        e if len(e := cluster.events("ConfigurationError")) >= 2 else None))
    assert all(MESSAGE in e["message"] for e in events), events
    # No replacement: the peer goes, the failed pod stays for its logs.
    wait_for("peer deleted", lambda: cluster.worker_names() == ["demo-worker-0-0"] or None)
    shown = subprocess.run(
        [sys.executable, "-m", "elastrain_cli", "describe", "demo", "-n", cluster.ns,
         "--kubeconfig", str(cluster.kube_fixture.kubeconfig)],
        capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "ConfigurationError" in shown.stdout and MESSAGE in shown.stdout, shown.stdout


def test_a_crash_still_restarts_after_backoff(cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2, restartPolicy={**POLICY, "backoffSeconds": 2,
                                                  "maxBackoffSeconds": 2})
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-0-0", 1, message=(
        "elastrain: worker crashed: rank 0, exit code 1: KeyError: 'tokens'"))
    status = wait_for("restart counted", lambda: (
        s if (s := cluster.status()).get("restarts") == 1 else None))
    assert status["phase"] != "Failed" and status.get("restartBackoffUntil"), status
    cluster.wait_workers(["demo-worker-0-1", "demo-worker-1-0"])
    assert cluster.status()["phase"] != "Failed"
