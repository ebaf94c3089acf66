"""`elastrain describe` against the real apiserver while the operator runs a job."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.operator.conftest import Cluster, Operator, wait_for

pytestmark = pytest.mark.cluster


def describe(cluster: Cluster, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastrain_cli", "describe", name, "-n", cluster.ns,
         "--kubeconfig", str(cluster.kube_fixture.kubeconfig)],
        capture_output=True, text=True, timeout=60)


def test_describe_shows_workers_and_losses(cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2)
    cluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0"])
    cluster.run_all()
    cluster.exit("demo-worker-1-0", 143, disruption="PreemptionByScheduler")
    wait_for("replacement", lambda: "demo-worker-1-1" in cluster.worker_names() or None)

    shown = describe(cluster, "demo")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "demo-worker-0-0" in out and "demo-worker-1-1" in out
    assert "PreemptionByScheduler" in out


def test_describe_of_a_missing_job_is_a_clear_error(cluster: Cluster) -> None:
    shown = describe(cluster, "nope")
    assert shown.returncode == 2
    assert f"TrainingJob {cluster.ns}/nope not found" in shown.stderr
