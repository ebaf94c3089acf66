"""describe_job's text, the RBAC rules' shape, metric names, the CLI parser, the job gate."""

from __future__ import annotations

import threading
from typing import Any

import kubernetes_validate
from prometheus_client import generate_latest

from elastrain_operator import metrics
from elastrain_operator.__main__ import build_parser
from elastrain_operator.describe import describe_job
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.rbac import RULES
from elastrain_operator.reconcile import JobGate
from elastrain_operator.render.rendezvous import render_store_pod, render_store_service
from elastrain_operator.render.service import render_worker_service
from elastrain_operator.render.workers import render_worker_pod
from tests.unit.operator.test_planning import T0, started


def test_describe_shows_workers_budgets_progress_and_losses() -> None:
    w = started(restartPolicy={"maxPreemptions": 5})
    w.set_pod("demo-worker-1-0", "Failed", exit_code=143, disruption="PreemptionByScheduler")
    w.reconcile(T0, progress=None)
    w.job["status"]["progress"] = {"step": 42, "totalSteps": 100, "loss": 2.5, "worldSize": 1}
    w.job["status"]["lastCheckpoint"] = {"step": 40, "uri": "s3://bkt/run/40",
                                         "time": "2026-01-01T00:00:00Z"}
    w.pods["demo-worker-0-0"]["spec"]["nodeName"] = "node-a"
    text = describe_job(w.job, list(w.pods.values()))
    assert text.splitlines()[0] == (
        "TrainingJob ml/demo: Running, workers 1/2 (min 1, max 4)")
    assert "Progress: step 42/100, loss 2.5, world size 1" in text
    assert "Last checkpoint: step 40 s3://bkt/run/40" in text
    assert "Restarts 0/3, preemptions 1/5" in text
    assert "Rendezvous store: demo-rdzv Running on unscheduled\n" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  0 ")
            or line.startswith("  1 ")]
    assert rows[0][:6] == ["0", "demo-worker-0-0", "Running", "yes", "node-a", "0"]
    assert rows[1][:3] == ["1", "demo-worker-1-1", "Pending"]
    assert "worker 1  demo-worker-1-0  Preempted: DisruptionTarget: PreemptionByScheduler" in text
    assert "AllWorkersRunning=False WorkersPending" in text
    assert "Last recovery" not in text
    assert ("Recovery: InProcess (survivors keep training in their processes, "
            "spec.recovery.mode unset)") in text
    restart = started(recovery={"mode": "Restart"})
    assert "Recovery: Restart (every worker restarts from the newest checkpoint)\n" in (
        describe_job(restart.job, list(restart.pods.values())))
    assert "Experimental" not in text


def test_describe_and_status_mark_inprocess_on_gpus_experimental() -> None:
    w = started(recovery={"mode": "InProcess"},
                resources={"limits": {"cpu": "1", "nvidia.com/gpu": 1}})
    w.reconcile(T0, progress=None)
    [cond] = [c for c in w.job["status"]["conditions"] if c["type"] == "Experimental"]
    assert cond["status"] == "True" and cond["reason"] == "InProcessOnGPU"
    assert "have not run on a GPU in elastrain's tests" in cond["message"]
    text = describe_job(w.job, list(w.pods.values()))
    assert f"Experimental: {cond['message']}\n" in text
    cpu = started(recovery={"mode": "InProcess"})
    cpu.reconcile(T0, progress=None)
    assert not [c for c in cpu.job["status"]["conditions"] if c["type"] == "Experimental"]
    # An update to Restart takes the job off that path: the condition says so, not stale.
    w.job["spec"]["recovery"]["mode"] = "Restart"
    w.reconcile(T0, progress=None)
    [cond] = [c for c in w.job["status"]["conditions"] if c["type"] == "Experimental"]
    assert (cond["status"], cond["reason"]) == ("False", "Verified")
    assert "Experimental" not in describe_job(w.job, list(w.pods.values()))


def test_describe_shows_the_last_training_recovery() -> None:
    w = started()
    w.job["status"]["lastRecovery"] = {
        "lostAt": "2026-01-01T00:00:10Z", "trainingAt": "2026-01-01T00:00:22.5Z",
        "seconds": 12.5, "kind": "Preempted", "pod": "demo-worker-1-0", "resumedFromStep": 20}
    text = describe_job(w.job, list(w.pods.values()))
    assert ("Last recovery: training resumed from step 20 12.5s after demo-worker-1-0 was lost "
            "(Preempted at 2026-01-01T00:00:10+00:00, training again at "
            "2026-01-01T00:00:22.500000+00:00)") in text


def test_rbac_rules_cover_what_the_operator_does_and_never_read_or_change_secrets() -> None:
    triples = {(g, r, v) for rule in RULES for g in rule.api_groups for r in rule.resources
               for v in rule.verbs}
    for needed in [("elastrain.dev", "trainingjobs/status", "patch"),
                   ("elastrain.dev", "trainingjobs/status", "update"),
                   ("elastrain.dev", "trainingjobs", "delete"),
                   ("", "pods", "create"), ("", "pods", "delete"), ("", "pods", "patch"),
                   ("", "pods", "watch"), ("", "services", "create"), ("", "events", "create"),
                   ("kopf.dev", "kopfpeerings", "patch"), ("", "secrets", "create")]:
        assert needed in triples, needed
    assert not [t for t in triples if "*" in t]
    assert sorted(t for t in triples if t[1] == "nodes") == [("", "nodes", "list"),
                                                             ("", "nodes", "watch")]
    assert [t for t in triples if t[1] == "secrets"] == [("", "secrets", "create")]


def test_metric_names() -> None:
    """Each recorder moves its series by what it was given. Read as deltas: the registry is the
    process's, and other tests in this process (reconcile rounds run in-process) record too."""
    expected = {('elastrain_operator_jobs', (('phase', 'Running'),)): 1.0,
                ('elastrain_operator_reconcile_total', (('result', 'error'),)): 1.0,
                ('elastrain_operator_reconcile_errors_total', ()): 1.0,
                ('elastrain_operator_workers_created_total', ()): 2.0,
                ('elastrain_operator_restarts_total', ()): 1.0,
                ('elastrain_operator_preemptions_total', ()): 2.0,
                ('elastrain_operator_recovery_seconds_count', ()): 1.0,
                ('elastrain_operator_training_recovery_seconds_count', ()): 1.0,
                ('elastrain_operator_training_recovery_seconds_bucket', (('le', '1800.0'),)): 1.0,
                ('elastrain_operator_reconcile_duration_seconds_count', ()): 2.0,
                ('elastrain_operator_workers_desired', ()): 3.0,
                ('elastrain_operator_workers_ready', ()): 2.0}

    def values() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {key: metrics.REGISTRY.get_sample_value(key[0], dict(key[1])) or 0.0
                for key in expected}

    before = values()
    metrics.record_reconcile("success", 0.01)
    metrics.record_reconcile("error", 0.2)
    metrics.record_workers_created(2)
    metrics.record_losses(restarts=1, preemptions=2)
    metrics.record_recovery(5.0)
    metrics.record_training_recovery(12.5)
    metrics.record_job("u1", "Running", desired=3, ready=2)
    metrics.record_job("u2", "Running", desired=5, ready=5)
    metrics.record_job("u2", None)
    after = values()
    assert {key: after[key] - before[key] for key in expected} == expected
    text = generate_latest(metrics.REGISTRY).decode()
    assert all(f"{name}{{" in text or f"{name} " in text for name, _ in expected)


def test_command_line() -> None:
    args = build_parser().parse_args(["--standalone", "-n", "ml", "-n", "ops",
                                      "--liveness", "http://0.0.0.0:8080/healthz",
                                      "--metrics-port", "9090"])
    assert args.standalone and args.namespace == ["ml", "ops"] and args.metrics_port == 9090
    args = build_parser().parse_args(["--priority", "7"])
    assert args.peering == "elastrain" and args.priority == 7 and not args.namespace


def test_gate_coalesces_concurrent_triggers() -> None:
    gate = JobGate()
    calls: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def slow() -> None:  # busy until the test has sent its triggers, however slow the machine
        calls.append(1)
        entered.set()
        release.wait(5)

    first = threading.Thread(target=gate.run, args=(("ns", "a"), slow))
    first.start()
    entered.wait(5)
    assert gate.run(("ns", "a"), slow) is False  # marked dirty, the runner goes again
    assert gate.run(("ns", "a"), slow) is False  # coalesced with the previous trigger
    assert gate.run(("ns", "b"), lambda: None) is True  # other jobs are not blocked
    release.set()
    first.join(5)
    assert len(calls) == 2


def job(**spec: Any) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": "demo", "namespace": "ml", "uid": "u1"},
        "spec": {"image": "img", **spec}})


def test_children_validate_against_the_kubernetes_schema() -> None:
    j = job(checkpoint={"uri": "s3://bkt/run", "credentialsSecret": {"name": "c"}},
            template={"tolerations": [{"key": "spot", "operator": "Exists"}],
                      "affinity": {"nodeAffinity": {}}},
            resources={"limits": {"cpu": "2", "memory": "4Gi"}},
            env=[{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}])
    for manifest in (render_worker_pod(j, 3, 1), render_worker_service(j), render_store_pod(j),
                     render_store_service(j)):
        kubernetes_validate.validate(manifest, "1.34", strict=True)
