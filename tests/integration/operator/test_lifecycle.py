"""The operator against a real apiserver, scheduler and garbage collector; pods are driven by hand.

Each test runs `python -m elastrain_operator --standalone --namespace <test ns>` with a 1 s timer.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from elastrain_operator.k8s.client import namespaced
from elastrain_trainer.ports import free_port
from tests.integration.operator.conftest import Cluster, Operator, wait_for

pytestmark = pytest.mark.cluster


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom"))
            for e in pod["spec"]["containers"][0]["env"]}


def running(cluster: Cluster, names: list[str], job: str = "demo") -> None:
    cluster.wait_workers(names, job)
    cluster.run_all(job)
    wait_for("phase Running with all workers ready",
             lambda: cluster.status(job).get("workers") == f"{len(names)}/{len(names)}"
             and cluster.status(job).get("phase") == "Running")


def test_create_renders_owned_children(cluster: Cluster, operator: Operator) -> None:
    job = cluster.create_job(replicas=2, rendezvous={"store": {"nodeSelector": {
        "kubernetes.io/hostname": "node-a"}}})
    cluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0"])
    pods = cluster.pods()
    store = wait_for("store pod", lambda: cluster.pods(role="rdzv-store").get("demo-rdzv"))
    for pod in [*pods.values(), store]:
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["uid"] == job["metadata"]["uid"] and owner["controller"] is True
    worker = pods["demo-worker-1-0"]
    assert worker["spec"]["hostname"] == "demo-worker-1"
    assert worker["spec"]["subdomain"] == "demo-workers"
    assert worker["metadata"]["finalizers"] == ["elastrain.dev/worker-accounting"]
    env = env_of(worker)
    assert env["PET_RDZV_ENDPOINT"] == f"demo-rdzv.{cluster.ns}.svc:29400"
    assert env["PET_RDZV_CONF"].startswith("is_host=false,")
    assert env["PET_RDZV_ID"] == job["metadata"]["uid"]
    assert store["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "node-a"}
    # As stored: the apiserver's DefaultTolerationSeconds adds 300 s only to a pod naming neither
    # node-loss taint; these name both, with spec.recovery.nodeLossTolerationSeconds.
    for pod in (worker, store):
        loss = {t["key"]: t.get("tolerationSeconds") for t in pod["spec"]["tolerations"]
                if t.get("effect") == "NoExecute"}
        assert loss == {"node.kubernetes.io/not-ready": 30, "node.kubernetes.io/unreachable": 30}
    services = cluster.kubectl("get", "svc", "-o", "json").stdout
    names = {s["metadata"]["name"]: s for s in json.loads(services)["items"]}
    assert names["demo-workers"]["spec"]["clusterIP"] == "None"
    assert names["demo-rdzv"]["spec"]["ports"][0]["port"] == 29400
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    status = cluster.status()
    assert status["readyReplicas"] == 2 and status["replicas"] == 2
    assert cluster.condition("Running")["status"] == "True"
    assert wait_for("WorkersRunning event", lambda: cluster.events("WorkersRunning"))


def test_preempted_worker_is_replaced_without_spending_restarts(
        cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2)
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-1-0", 143, disruption="PreemptionByScheduler")
    cluster.wait_workers(["demo-worker-0-0", "demo-worker-1-1"])
    status = wait_for("preemption counted", lambda: cluster.status()
                      if cluster.status().get("preemptions") == 1 else None)
    assert status["restarts"] == 0
    assert status["recentLosses"][0]["reason"] == "DisruptionTarget: PreemptionByScheduler"
    assert wait_for("WorkerPreempted event", lambda: cluster.events("WorkerPreempted"))
    running(cluster, ["demo-worker-0-0", "demo-worker-1-1"])
    wait_for("recovered", lambda: "recoveringSince" not in cluster.status())


def test_eviction_and_deletion_count_as_preemptions(cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2)
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.evict("demo-worker-0-0")
    cluster.wait_workers(["demo-worker-0-1", "demo-worker-1-0"])
    cluster.delete_pod("demo-worker-1-0")
    cluster.wait_workers(["demo-worker-0-1", "demo-worker-1-1"])
    wait_for("two preemptions", lambda: cluster.status().get("preemptions") == 2)
    kinds = [loss["reason"] for loss in cluster.status()["recentLosses"]]
    assert kinds[0] == "DisruptionTarget: EvictionByEvictionAPI"
    assert cluster.status()["restarts"] == 0
    # Old pods are gone for good: the finalizer was released after counting.
    wait_for("stale pods gone", lambda: sorted(cluster.pods(live=False)) == [
        "demo-worker-0-1", "demo-worker-1-1"])


def test_failures_back_off_then_exhaust_the_budget(cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2, restartPolicy={"maxRestarts": 1, "backoffSeconds": 2,
                                                  "maxBackoffSeconds": 2})
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-0-0", 1)
    status = wait_for("restart counted", lambda: cluster.status()
                      if cluster.status().get("restarts") == 1 else None)
    assert status["preemptions"] == 0 and status.get("restartBackoffUntil")
    assert wait_for("Backoff reported", lambda: cluster.condition("Restarting").get("reason")
                    in ("Backoff", "WorkerFailed"))
    cluster.wait_workers(["demo-worker-0-1", "demo-worker-1-0"])
    cluster.run_all()
    cluster.exit("demo-worker-1-0", 137, reason="OOMKilled")
    wait_for("job failed", lambda: cluster.status().get("phase") == "Failed")
    failed = cluster.condition("Failed")
    assert failed["reason"] == "MaxRestartsExceeded"
    assert "spec.restartPolicy.maxRestarts (1)" in failed["message"]
    assert cluster.status()["restarts"] == 2
    assert wait_for("MaxRestartsExceeded event", lambda: cluster.events("MaxRestartsExceeded"))
    # Running workers and the store go; the failed pod stays for its logs, finalizer released.
    wait_for("running workers deleted", lambda: cluster.worker_names() == ["demo-worker-1-0"])
    assert not cluster.pods(role="rdzv-store")
    assert cluster.pods()["demo-worker-1-0"]["metadata"].get("finalizers") in (None, [])


CRASH = ("elastrain: worker crashed: rank 1, exit code 1: InjectedCrash: injected crash at "
         "step 10 on rank 1 (ELASTRAIN_FAULT_CRASH_AT_STEP)")


def test_a_trainer_crash_is_counted_and_quoted_and_lost_peers_are_not(
        cluster: Cluster, operator: Operator) -> None:
    """The launcher ends a crashed worker's pod with its reason in the termination message
    (elastrain_trainer.launch): each crash spends the budget, a preemption meanwhile does not,
    and the job fails quoting the trainer's exception."""
    cluster.create_job(replicas=2, restartPolicy={"maxRestarts": 1, "backoffSeconds": 0})
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-1-0", 1, message=f"Traceback (most recent call last):\n{CRASH}\n")
    wait_for("crash counted", lambda: cluster.status().get("restarts") == 1)
    # Two events carry this reason: the crash's own, and the Restarting condition's transition
    # (listed in the order of their random names).
    failed = wait_for("WorkerFailed event", lambda: [
        e for e in cluster.events("WorkerFailed") if "demo-worker-1-0" in e["message"]])
    assert "InjectedCrash: injected crash at step 10" in failed[0]["message"]
    cluster.wait_workers(["demo-worker-0-0", "demo-worker-1-1"])
    cluster.run_all()
    cluster.exit("demo-worker-0-0", 143, disruption="PreemptionByScheduler")
    wait_for("preemption counted", lambda: cluster.status().get("preemptions") == 1)
    assert cluster.status()["restarts"] == 1
    cluster.wait_workers(["demo-worker-0-1", "demo-worker-1-1"])
    cluster.run_all()
    cluster.exit("demo-worker-1-1", 1, message=CRASH)
    wait_for("job failed", lambda: cluster.status().get("phase") == "Failed")
    status = cluster.status()
    assert (status["restarts"], status["preemptions"]) == (2, 1)
    message = cluster.condition("Failed")["message"]
    assert message.startswith("2 worker failures exceed spec.restartPolicy.maxRestarts (1); "
                              "last: demo-worker-1-1: exit code 1, Error, rank 1, exit code 1: "
                              "InjectedCrash: injected crash at step 10"), message


def test_scale_subresource_and_pending_workers(cluster: Cluster, operator: Operator) -> None:
    # The fake node has 64 CPUs: three 30-CPU workers cannot all be scheduled.
    cluster.create_job(replicas=1, resources={"requests": {"cpu": "30"}})
    running(cluster, ["demo-worker-0-0"])
    cluster.kubectl("scale", "tj/demo", "--replicas=3")
    cluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"])
    wait_for("one worker unschedulable", lambda: cluster.status().get("pendingReplicas") == 2)
    cluster.run("demo-worker-1-0")
    wait_for("pending reported", lambda: cluster.status().get("pendingReplicas") == 1
             and cluster.condition("AllWorkersRunning").get("reason") == "WorkersPending")
    assert cluster.status()["phase"] == "Running"
    assert "Insufficient cpu" in wait_for(
        "scheduler message", lambda: cluster.condition("AllWorkersRunning")["message"]
        if "Insufficient" in cluster.condition("AllWorkersRunning")["message"] else None)
    cluster.kubectl("scale", "tj/demo", "--replicas=1")
    cluster.wait_workers(["demo-worker-0-0"])
    wait_for("scaled down", lambda: cluster.status().get("workers") == "1/1")
    status = cluster.status()
    assert (status["restarts"], status["preemptions"], status["pendingReplicas"]) == (0, 0, 0)
    scale = cluster.kubectl("get", "--raw", f"/apis/elastrain.dev/v1alpha1/namespaces/"
                            f"{cluster.ns}/trainingjobs/demo/scale").stdout
    assert json.loads(scale)["status"]["selector"] == (
        "elastrain.dev/job-name=demo,elastrain.dev/role=worker")


def test_suspend_and_resume(cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2)
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.patch_spec(suspend=True)
    cluster.wait_workers([])
    wait_for("Suspended", lambda: cluster.status().get("phase") == "Suspended")
    wait_for("store deleted", lambda: not cluster.pods(role="rdzv-store", live=False))
    assert cluster.condition("Suspended")["status"] == "True"
    cluster.patch_spec(suspend=False)
    cluster.wait_workers(["demo-worker-0-1", "demo-worker-1-1"])
    running(cluster, ["demo-worker-0-1", "demo-worker-1-1"])
    assert cluster.condition("Suspended")["reason"] == "JobResumed"
    status = cluster.status()
    assert (status["restarts"], status["preemptions"]) == (0, 0)


def test_success_then_ttl_deletes_the_job(cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2, ttlSecondsAfterFinished=2)
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-0-0", 0, reason="Completed")
    wait_for("finishing", lambda: cluster.condition("Running").get("reason") == "JobFinishing")
    assert cluster.status()["phase"] == "Running"  # one worker done is not the job done
    cluster.exit("demo-worker-1-0", 0, reason="Completed")
    wait_for("Succeeded", lambda: cluster.status().get("phase") == "Succeeded")
    assert cluster.condition("Succeeded")["reason"] == "AllWorkersSucceeded"
    wait_for("TTL deleted the job", lambda: cluster.job() is None, timeout=30)
    wait_for("children collected", lambda: not cluster.pods(live=False)
             and not cluster.pods(role="rdzv-store", live=False), timeout=60)


def test_deadline_fails_the_job(cluster: Cluster, operator: Operator) -> None:
    cluster.create_job(replicas=2, activeDeadlineSeconds=3)
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    wait_for("deadline", lambda: cluster.status().get("phase") == "Failed", timeout=30)
    assert cluster.condition("Failed")["reason"] == "DeadlineExceeded"
    cluster.wait_workers([])


def test_deleting_the_job_garbage_collects_everything(cluster: Cluster,
                                                      operator: Operator) -> None:
    cluster.create_job(replicas=3)
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"])
    cluster.kubectl("delete", "tj/demo", "--wait=false")
    wait_for("pods collected", lambda: not cluster.pods(live=False)
             and not cluster.pods(role="rdzv-store", live=False), timeout=60)
    wait_for("services collected", lambda: not json.loads(
        cluster.kubectl("get", "svc", "-o", "json").stdout)["items"], timeout=60)


def test_a_job_deleted_while_no_operator_runs_goes_at_once(cluster: Cluster,
                                                           operator: Operator) -> None:
    # kopf puts a finalizer on every object a timer runs for; the operator registers its timer
    # without one, so deleting a job never waits for an operator to be up.
    cluster.create_job(replicas=1)
    running(cluster, ["demo-worker-0-0"])
    job = cluster.job()
    assert job is not None and not job["metadata"].get("finalizers"), job["metadata"]
    operator.stop()
    cluster.kubectl("delete", "tj/demo", "--wait=false")
    wait_for("the job gone with no operator running", lambda: cluster.job() is None, timeout=20)
    # Its worker keeps the accounting finalizer until an operator releases it as an orphan.
    assert cluster.pods(live=False)
    operator.start()
    wait_for("the orphaned worker released and collected", lambda: not cluster.pods(live=False),
             timeout=60)


def test_invalid_spec_is_a_condition_not_a_crash(cluster: Cluster, operator: Operator) -> None:
    # A spec the CRD can judge alone never gets here (admission refuses it); a child's name
    # taken by someone else's Service is what only the operator sees.
    cluster.kube.request("POST", namespaced("v1", cluster.ns, "services"), body={
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken-workers"},
        "spec": {"clusterIP": "None", "ports": [{"port": 80}]}})
    cluster.create_job(name="taken")
    wait_for("Valid=False", lambda: cluster.condition("Valid", "taken").get("status") == "False")
    assert cluster.condition("Valid", "taken")["message"] == (
        "Service 'taken-workers' exists and is not owned by this TrainingJob")
    assert not cluster.pods("taken")
    cluster.create_job(name="creds", checkpoint={"uri": "s3://bucket/run",
                                                  "credentialsSecret": {"name": "missing"}})
    cluster.wait_workers(["creds-worker-0-0", "creds-worker-1-0"], job="creds")
    cluster.pod_status("creds-worker-0-0", {"containerStatuses": [{
        "name": "trainer", "image": "trainer:dev", "imageID": "", "ready": False,
        "restartCount": 0, "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                 "message": 'secret "missing" not found'}}}]})
    wait_for("kubelet error reported", lambda: 'secret "missing" not found' in
             cluster.condition("Valid", "creds").get("message", ""))
    assert cluster.worker_names("creds") == ["creds-worker-0-0", "creds-worker-1-0"]
    assert operator.proc is not None and operator.proc.poll() is None


class _Progress(BaseHTTPRequestHandler):
    payload: dict[str, Any] = {}
    polls = 0  # GET /progress answered: the operator's polls, seen from the worker's side

    def do_GET(self) -> None:
        if self.path == "/progress":
            type(self).polls += 1
        body = json.dumps(self.payload).encode()
        self.send_response(200 if self.path == "/progress" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def progress_server() -> Iterator[ThreadingHTTPServer]:
    _Progress.payload = {"step": 42, "totalSteps": 100, "loss": 2.5, "worldSize": 2,
                         "lastCheckpoint": {"step": 40, "uri": "s3://bucket/run/step-40",
                                            "time": "2026-01-01T00:00:00Z"}}
    _Progress.polls = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Progress)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_progress_is_polled_from_ready_workers(cluster: Cluster, operator: Operator,
                                               progress_server: ThreadingHTTPServer) -> None:
    cluster.create_job(replicas=1, metricsPort=progress_server.server_address[1])
    running(cluster, ["demo-worker-0-0"])
    status = wait_for("progress in status", lambda: cluster.status()
                      if cluster.status().get("progress") else None)
    assert status["progress"] == {"step": 42, "totalSteps": 100, "loss": 2.5, "worldSize": 2}
    assert status["lastCheckpoint"]["uri"] == "s3://bucket/run/step-40"
    columns = cluster.kubectl("get", "tj", "demo").stdout.splitlines()[1].split()
    assert columns[:5] == ["demo", "Running", "1/1", "42", "40"]


def test_training_recovery_is_recorded_once_per_loss(
        cluster: Cluster, operator_factory: Callable[..., Operator],
        progress_server: ThreadingHTTPServer) -> None:
    metrics_port = free_port()
    op = operator_factory("--standalone", "--metrics-port", str(metrics_port))
    op.start()
    cluster.create_job(replicas=1, metricsPort=progress_server.server_address[1])
    running(cluster, ["demo-worker-0-0"])
    cluster.exit("demo-worker-0-0", 143, disruption="PreemptionByScheduler")
    status = wait_for("the loss counted", lambda: s if (s := cluster.status()).get(
        "recentLosses") else None)
    lost_at = datetime.fromisoformat(status["recentLosses"][-1]["time"])
    training_at = (lost_at + timedelta(seconds=3)).isoformat().replace("+00:00", "Z")
    _Progress.payload = {**_Progress.payload, "step": 41, "resumedFromStep": 40,
                         "trainingSince": training_at}
    running(cluster, ["demo-worker-0-1"])
    recovery = wait_for("status.lastRecovery", lambda: cluster.status().get("lastRecovery"))
    assert recovery == {"lostAt": status["recentLosses"][-1]["time"], "trainingAt": training_at,
                        "seconds": 3.0, "kind": "Preempted", "pod": "demo-worker-0-0",
                        "resumedFromStep": 40, "mode": "Restart"}
    (event,) = wait_for("TrainingResumed event", lambda: cluster.events("TrainingResumed"))
    assert event["message"] == "training resumed from step 40 3.0s after demo-worker-0-0 was lost"
    wait_for("the recovery in /metrics", lambda: "elastrain_operator_training_recovery_seconds_"
             "count 1.0" in (_get(f"http://127.0.0.1:{metrics_port}/metrics") or ""))
    # The same report, polled again and by a restarted operator, records nothing more.
    op.kill()
    polled = _Progress.polls
    op.start()
    wait_for("the restarted operator reconciling", lambda: 'reconcile_total{result="success"}'
             in (_get(f"http://127.0.0.1:{metrics_port}/metrics") or ""))
    # A job's polls run one at a time, each planned on before the next: the third poll by the
    # restarted operator means it has planned on the same report at least twice.
    wait_for("three polls by the restarted operator", lambda: _Progress.polls >= polled + 3)
    text = _get(f"http://127.0.0.1:{metrics_port}/metrics") or ""
    assert "elastrain_operator_training_recovery_seconds_count 0.0" in text
    assert len(cluster.events("TrainingResumed")) == 1
    assert cluster.status()["lastRecovery"] == recovery


def test_liveness_and_metrics_endpoints(cluster: Cluster,
                                        operator_factory: Callable[..., Operator]) -> None:
    live_port, metrics_port = free_port(), free_port()
    op = operator_factory("--standalone", "--liveness", f"http://127.0.0.1:{live_port}/healthz",
                          "--metrics-port", str(metrics_port))
    op.start()
    health = wait_for("liveness endpoint", lambda: _get(f"http://127.0.0.1:{live_port}/healthz"))
    assert health.startswith("{")
    cluster.create_job(replicas=2)
    running(cluster, ["demo-worker-0-0", "demo-worker-1-0"])
    cluster.exit("demo-worker-0-0", 143, disruption="PreemptionByScheduler")
    cluster.wait_workers(["demo-worker-0-1", "demo-worker-1-0"])
    text = wait_for("the preemption in /metrics", lambda: (
        body if "elastrain_operator_preemptions_total 1.0" in (
            body := _get(f"http://127.0.0.1:{metrics_port}/metrics") or "") else None))
    assert "elastrain_operator_workers_created_total 3.0" in text
    assert 'elastrain_operator_reconcile_total{result="success"}' in text


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as rsp:
            return str(rsp.read().decode())
    except OSError:
        return None
