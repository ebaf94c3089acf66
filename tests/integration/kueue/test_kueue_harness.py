"""The Kueue harness against a real Kueue manager and apiserver: Jobs are suspended and admitted
within quota, a Workload made by hand (as elastrain's operator will) is admitted, and namespaces
Kueue does not select are untouched. No kubelet: admission is what these tests look at."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain_operator.k8s.client import Kube, KubeError, namespaced
from hack import kueue as harness
from tests.conftest import Kube as KubeFixture
from tests.integration.kueue.fixtures import (
    QUEUE_LABEL,
    KueueQueues,
    admitted,
    condition,
    is_true,
    make_job,
    make_workload,
    tried,
    wait_for,
)

pytestmark = pytest.mark.cluster
GATE = "kueue.x-k8s.io/admission"  # the scheduling gate Kueue's pod webhook adds


def test_a_job_is_suspended_then_admitted_and_one_past_the_quota_waits(
        kueue_queues: KueueQueues) -> None:
    queue = kueue_queues.make_queue(cpu="2")

    first = kueue_queues.create_job(make_job("first", queue=queue, cpu="1"))
    assert first["spec"]["suspend"] is True, "Kueue's Job webhook did not suspend the job"
    workload = wait_for("the first job's Workload admitted",
                        lambda: admitted(kueue_queues.workload_of_job("first")), timeout=60)
    assert workload["spec"]["queueName"] == queue
    wait_for("the first job unsuspended by Kueue",
             lambda: (kueue_queues.job("first") or {}).get("spec", {}).get("suspend") is False,
             timeout=60)

    kueue_queues.create_job(make_job("second", queue=queue, cpu="2"))
    pending = wait_for("the second job's Workload tried and left without quota",
                       lambda: tried(kueue_queues.workload_of_job("second")), timeout=60)
    reserved = condition(pending, "QuotaReserved")
    assert reserved and reserved["status"] == "False", reserved
    assert not is_true(pending, "Admitted")
    assert (kueue_queues.job("second") or {})["spec"]["suspend"] is True


def test_a_workload_made_by_hand_is_admitted_and_reads_as_v1beta1(
        kueue_queues: KueueQueues) -> None:
    queue = kueue_queues.make_queue(cpu="2")
    # The exact minimal manifest elastrain's operator will write (kueue.x-k8s.io/v1beta2).
    manifest = make_workload("by-hand", queue=queue, cpu="1", count=2)
    assert manifest == {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": "by-hand"},
        "spec": {"queueName": "main", "podSets": [{"name": "main", "count": 2, "template": {
            "spec": {"restartPolicy": "Never", "containers": [{
                "name": "main", "image": "elastrain/none:0",
                "resources": {"requests": {"cpu": "1"}}}]}}}]},
    }
    kueue_queues.create_workload(manifest)

    workload = wait_for("the Workload admitted",
                        lambda: admitted(kueue_queues.workload("by-hand")), timeout=60)
    assignment = workload["status"]["admission"]["podSetAssignments"][0]
    assert assignment["name"] == "main" and assignment["count"] == 2
    # make_queue names the flavor after its ClusterQueue.
    assert assignment["flavors"] == {"cpu": workload["status"]["admission"]["clusterQueue"]}
    assert assignment["resourceUsage"]["cpu"] == "2"
    # v1beta1 is served too: the apiserver converts through the manager's webhook (strategy
    # Webhook), and fails the read if it cannot reach it.
    crd = kueue_queues.kube.get(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/workloads.kueue.x-k8s.io")
    assert crd and crd["spec"]["conversion"]["strategy"] == "Webhook"
    old = kueue_queues.workload("by-hand", version="kueue.x-k8s.io/v1beta1")
    assert old is not None and old["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    assert old["spec"]["queueName"] == queue and is_true(old, "Admitted")


def _pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {QUEUE_LABEL: "main"}},
            "spec": {"containers": [{"name": "main", "image": "elastrain/none:0"}]}}


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOPs `pid` and returns once every thread has stopped: a thread busy when the signal
    came runs on for a moment (/proc showed the process running right after os.kill)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for("every thread stopped", lambda: all(
            stat.read_text().rpartition(")")[2].split()[0] in ("T", "t")
            for stat in Path(f"/proc/{pid}/task").glob("*/stat")), timeout=10)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_frozen_kueue_breaks_nothing_outside_its_namespaces(
        kueue: harness.Kueue, kube: KubeFixture, kube_namespace: str,
        kueue_namespace: str) -> None:
    """Kueue's webhooks fail closed: only their namespaceSelector keeps a hung manager from
    failing every pod and Job on the shared apiserver. (Kueue itself also ignores pods outside
    managedJobsNamespaceSelector, so a live manager alone would not show it.)"""
    with kube.api_client() as api_client:
        api = Kube(api_client)
        managed = api.request("POST", namespaced("v1", kueue_namespace, "pods"),
                              body=_pod("managed"))
        assert {"name": GATE} in managed["spec"].get("schedulingGates", []), \
            "Kueue's pod webhook is not live in its own namespace"
        with frozen(kueue.proc.pid):
            plain = api.request("POST", namespaced("v1", kube_namespace, "pods"),
                                body=_pod("plain"))
            assert plain["spec"].get("schedulingGates") is None
            job = api.request("POST", namespaced("batch/v1", kube_namespace, "jobs"),
                              body=make_job("plain", queue="main", cpu="1"))
            assert job["spec"]["suspend"] is False
            # Inside, the same pod now fails closed after the webhook's 10 s timeout.
            with pytest.raises(KubeError, match="failed calling webhook"):
                api.request("POST", namespaced("v1", kueue_namespace, "pods"),
                            body=_pod("refused"))


def test_the_manager_costs_what_the_readme_says(kueue: harness.Kueue) -> None:
    """Start time and memory are reported here (-rA shows them) and bounded loosely, so a
    regression of an order of magnitude is seen."""
    rss_mib = kueue.rss_kib() / 1024
    print(f"kueue: installed in {kueue.install_seconds:.1f} s, started in "
          f"{kueue.start_seconds:.1f} s, RSS {rss_mib:.0f} MiB")
    assert kueue.start_seconds < 60
    assert rss_mib < 512
