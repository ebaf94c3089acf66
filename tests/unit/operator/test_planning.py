"""plan(): a job and its observed children -> status and children, driven through a fake world.

The fake world applies a plan the way the shell does (status first, then pods) and can stop
after any step, which is how an operator restart at any moment is simulated.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from elastrain_operator.model import conditions as c
from elastrain_operator.model.names import WORKER_FINALIZER
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.policy.failures import read_worker_pod
from elastrain_operator.policy.planning import Observed, Plan, plan
from elastrain_operator.policy.progress import parse_progress
from elastrain_operator.policy.store import read_store_pod

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class World:
    """A TrainingJob and its children, mutated like an apiserver would."""

    job: dict[str, Any]
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    services: set[str] = field(default_factory=set)
    deleted_job: bool = False
    clock: datetime = T0  # the apiserver's: stamps creationTimestamp
    created: int = 0

    @classmethod
    def new(cls, **spec: Any) -> World:
        return cls(job={"metadata": {"name": "demo", "namespace": "ml", "uid": "u1",
                                     "generation": 1},
                        "spec": {"image": "img", "replicas": 2, "minReplicas": 1,
                                 "maxReplicas": 4, **spec}})

    def parsed(self) -> TrainingJob:
        return TrainingJob.model_validate(self.job)

    def observe(self, progress: Any = None, notices: Any = None,
                notices_off: str = "", lost_nodes: Any = None,
                lost_since: Any = None) -> Observed:
        workers = [read_worker_pod(p, WORKER_FINALIZER) for p in self.pods.values()
                   if p["metadata"]["labels"]["elastrain.dev/role"] == "worker"]
        store = self.pods.get("demo-rdzv")
        return Observed(
            workers=tuple(w for w in workers if w is not None),
            store=None if store is None else read_store_pod(store),
            services=frozenset(self.services), progress=progress, notices=notices or {},
            notices_off=notices_off, lost_nodes=lost_nodes or {}, lost_since=lost_since or {})

    def plan(self, now: datetime, **kw: Any) -> Plan:
        return plan(self.parsed(), self.observe(**kw), now=now)

    def steps(self, p: Plan) -> list[Any]:
        """The plan as the shell's ordered side effects."""
        out: list[Any] = [lambda: self.job.__setitem__("status", p.status.to_api())]
        out += [lambda n=n: self.delete(n) for n in p.delete_pods]
        # grace 0 changes nothing here: a finalizer holds the object until it is released
        out += [lambda n=n: self.delete(n) for n in p.force_delete_pods]
        out += [lambda n=n: self.release(n) for n in p.release_pods]
        out += [lambda m=m: self.create(m) for m in p.create]
        if p.delete_job:
            out.append(lambda: setattr(self, "deleted_job", True))
        return out

    def apply(self, p: Plan, *, crash_after: int | None = None) -> None:
        for i, step in enumerate(self.steps(p)):
            if crash_after is not None and i >= crash_after:
                return
            step()

    def reconcile(self, now: datetime, **kw: Any) -> Plan:
        self.clock = now
        p = self.plan(now, **kw)
        self.apply(p)
        return p

    def create(self, manifest: dict[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        if manifest["kind"] == "Service":
            self.services.add(name)
        elif name not in self.pods:
            pod = copy.deepcopy(manifest)
            self.created += 1
            pod["metadata"].update(uid=f"{name}-{self.created}",
                                   creationTimestamp=self.clock.isoformat())
            pod["status"] = {"phase": "Pending"}
            self.pods[name] = pod

    def delete(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is None:
            return
        if pod["metadata"].get("finalizers"):
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        else:
            del self.pods[name]

    def release(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is None:
            return
        pod["metadata"]["finalizers"] = []
        if "deletionTimestamp" in pod["metadata"]:
            del self.pods[name]

    # --- what a kubelet/scheduler would do --------------------------------------------------
    def set_pod(self, name: str, phase: str, *, exit_code: int | None = None,
                disruption: str | None = None, ready: bool = True, message: str = "",
                at: datetime | None = None) -> None:
        """`at`: when the kubelet/apiserver stamped the disruption and the exit."""
        stamp = {} if at is None else {"lastTransitionTime": at.isoformat()}
        status: dict[str, Any] = {"phase": phase, "podIP": "127.0.0.1", "conditions": [
            {"type": "Ready", "status": "True" if ready and phase == "Running" else "False"}]}
        if disruption:
            status["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                         "reason": disruption, **stamp})
        if exit_code is not None:
            status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {
                "exitCode": exit_code, "reason": "Error" if exit_code else "Completed",
                "message": message, **({} if at is None else {"finishedAt": at.isoformat()})}}}]
        self.pods[name]["status"] = status

    def run_all(self) -> None:
        """Starts every pending worker, and the store pod (Ready), as a kubelet would."""
        for name in self.workers():
            if self.pods[name]["status"]["phase"] == "Pending":
                self.set_pod(name, "Running")
        store = self.pods.get("demo-rdzv")
        if store is not None and store["status"]["phase"] == "Pending":
            store["status"] = {"phase": "Running",
                               "conditions": [{"type": "Ready", "status": "True"}]}

    def workers(self, *, live: bool = True) -> list[str]:
        return sorted(n for n, p in self.pods.items()
                      if p["metadata"]["labels"]["elastrain.dev/role"] == "worker"
                      and not (live and "deletionTimestamp" in p["metadata"]))

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.job.get("status", {}))

    def condition(self, kind: str) -> dict[str, Any]:
        return next(x for x in self.status["conditions"] if x["type"] == kind)


def started(**spec: Any) -> World:
    w = World.new(**spec)
    w.reconcile(T0)
    w.run_all()
    w.reconcile(T0)
    return w


def test_create_makes_services_store_and_one_pod_per_slot() -> None:
    w = World.new()
    p = w.reconcile(T0)
    kinds = sorted((m["kind"], m["metadata"]["name"]) for m in p.create)
    assert kinds == [("Pod", "demo-rdzv"), ("Pod", "demo-worker-0-0"), ("Pod", "demo-worker-1-0"),
                     ("Service", "demo-rdzv"), ("Service", "demo-workers")]
    assert w.status["phase"] == "Pending"
    assert w.status["slots"] == [{"index": 0, "attempt": 0}, {"index": 1, "attempt": 0}]
    assert w.status["selector"] == "elastrain.dev/job-name=demo,elastrain.dev/role=worker"
    assert w.reconcile(T0).create == ()  # idempotent


def test_running_when_min_replicas_run() -> None:
    w = started()
    assert w.status["phase"] == "Running"
    assert w.status["workers"] == "2/2" and w.status["readyReplicas"] == 2
    assert w.condition(c.RUNNING)["status"] == "True"
    assert w.condition(c.ALL_WORKERS_RUNNING)["status"] == "True"


def test_preempted_worker_is_replaced_and_counted_as_preemption() -> None:
    w = started()
    w.set_pod("demo-worker-1-0", "Failed", exit_code=143, disruption="PreemptionByScheduler")
    p = w.reconcile(T0 + timedelta(seconds=5))
    assert (w.status["preemptions"], w.status["restarts"]) == (1, 0)
    assert p.counted_preemptions == 1
    assert [m["metadata"]["name"] for m in p.create] == ["demo-worker-1-1"]
    assert w.workers() == ["demo-worker-0-0", "demo-worker-1-1"]
    assert any(e.reason == c.WORKER_PREEMPTED for e in p.events)
    assert w.status["recentLosses"][0]["kind"] == "Preempted"
    # Counted once: later rounds see the same pods and count nothing more.
    w.reconcile(T0 + timedelta(seconds=6))
    assert w.status["preemptions"] == 1


def test_failed_worker_counts_a_restart_and_waits_for_backoff() -> None:
    w = started(restartPolicy={"backoffSeconds": 10, "maxBackoffSeconds": 15})
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1)
    p = w.reconcile(T0)
    assert (w.status["restarts"], w.status["preemptions"]) == (1, 0)
    assert p.create == ()
    assert w.status["restartBackoffUntil"] == "2026-01-01T00:00:10Z"
    assert w.condition(c.RESTARTING)["reason"] == c.BACKOFF
    assert w.reconcile(T0 + timedelta(seconds=9)).create == ()
    p = w.reconcile(T0 + timedelta(seconds=10))
    assert [m["metadata"]["name"] for m in p.create] == ["demo-worker-0-1"]
    # The second failure doubles the delay, capped at maxBackoffSeconds.
    w.set_pod("demo-worker-0-1", "Failed", exit_code=137)
    w.reconcile(T0 + timedelta(seconds=20))
    assert w.status["restartBackoffUntil"] == "2026-01-01T00:00:35Z"


def test_budget_exhausted_fails_the_job_and_stops_workers() -> None:
    w = started(restartPolicy={"maxRestarts": 0})
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1)
    p = w.reconcile(T0)
    assert w.status["phase"] == "Failed"
    failed = w.condition(c.FAILED)
    assert failed["reason"] == c.MAX_RESTARTS_EXCEEDED and "maxRestarts (0)" in failed["message"]
    assert "demo-worker-1-0" in p.delete_pods and "demo-rdzv" in p.delete_pods
    assert not [n for n, pod in w.pods.items() if pod["metadata"].get("finalizers")]
    assert any(e.reason == c.MAX_RESTARTS_EXCEEDED and e.type == "Warning" for e in p.events)
    assert w.status["completionTime"] == "2026-01-01T00:00:00Z"


def test_preemption_budget() -> None:
    w = started(restartPolicy={"maxPreemptions": 1})
    w.set_pod("demo-worker-0-0", "Failed", disruption="EvictionByEvictionAPI")
    w.reconcile(T0)
    assert w.status["phase"] == "Running"
    w.run_all()
    w.set_pod("demo-worker-0-1", "Running", disruption="DeletionByTaintManager")
    w.reconcile(T0)
    assert w.status["phase"] == "Failed"
    assert w.condition(c.FAILED)["reason"] == c.MAX_PREEMPTIONS_EXCEEDED


def test_scale_up_and_down_counts_nothing() -> None:
    w = started()
    w.job["spec"]["replicas"] = 4
    p = w.reconcile(T0)
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-worker-2-0",
                                                                "demo-worker-3-0"]
    assert any(e.reason == c.SCALED for e in p.events)
    w.run_all()
    w.job["spec"]["replicas"] = 1
    p = w.reconcile(T0)
    assert sorted(p.delete_pods) == ["demo-worker-1-0", "demo-worker-2-0", "demo-worker-3-0"]
    assert w.workers() == ["demo-worker-0-0"]
    assert (w.status["restarts"], w.status["preemptions"], w.status["replicas"]) == (0, 0, 1)
    w.job["spec"]["replicas"] = 2
    p = w.reconcile(T0)
    assert [m["metadata"]["name"] for m in p.create] == ["demo-worker-1-1"]


def test_pending_extra_workers_do_not_block_running() -> None:
    w = started(replicas=3, minReplicas=2)
    w.job["spec"]["replicas"] = 4
    w.reconcile(T0)
    w.pods["demo-worker-3-0"]["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/1 nodes are available: 1 Insufficient cpu."}]}
    w.reconcile(T0)
    assert w.status["phase"] == "Running" and w.status["pendingReplicas"] == 1
    cond = w.condition(c.ALL_WORKERS_RUNNING)
    assert cond["status"] == "False" and cond["reason"] == c.WORKERS_PENDING
    assert "Insufficient cpu" in cond["message"]


def terminating(w: World, pods: dict[str, Any]) -> None:
    """`pods` (worker pods as they were) deleted but still running their containers, as a
    kubelet keeps them until the containers exit (the World drops a deleted pod as soon as
    its finalizers are gone)."""
    for name, pod in pods.items():
        meta = {**pod["metadata"], "deletionTimestamp": "2026-01-01T00:00:50Z",
                "finalizers": []}
        w.pods[name] = {**copy.deepcopy(pod), "metadata": meta}


def test_suspend_deletes_workers_and_resume_recreates() -> None:
    w = started(activeDeadlineSeconds=100)
    w.job["spec"]["suspend"] = True
    running = {n: copy.deepcopy(w.pods[n]) for n in w.workers()}
    p = w.reconcile(T0 + timedelta(seconds=50))
    assert w.status["phase"] == "Suspended" and w.workers() == []
    assert "startTime" not in w.status
    # The store stays while the workers stop (their stop's save goes through it), then goes.
    assert "demo-rdzv" not in p.delete_pods
    terminating(w, running)  # their kubelet has not stopped them yet: they still run
    p = w.reconcile(T0 + timedelta(seconds=50.5))
    assert "demo-rdzv" not in p.delete_pods
    for name in w.workers(live=False):
        w.release(name)
        w.pods.pop(name, None)
    p = w.reconcile(T0 + timedelta(seconds=51))
    assert "demo-rdzv" in p.delete_pods
    assert (w.status["restarts"], w.status["preemptions"]) == (0, 0)
    w.job["spec"]["suspend"] = False
    p = w.reconcile(T0 + timedelta(seconds=500))
    assert sorted(m["metadata"]["name"] for m in p.create) == [
        "demo-rdzv", "demo-worker-0-1", "demo-worker-1-1"]
    assert w.condition(c.SUSPENDED)["reason"] == c.JOB_RESUMED
    assert w.status["startTime"] == "2026-01-01T00:08:20Z"  # deadline clock restarted


def test_deadline_fails_the_job() -> None:
    w = started(activeDeadlineSeconds=60)
    w.reconcile(T0 + timedelta(seconds=59))
    assert w.status["phase"] == "Running"
    p = w.reconcile(T0 + timedelta(seconds=60))
    assert w.status["phase"] == "Failed"
    assert w.condition(c.FAILED)["reason"] == c.DEADLINE_EXCEEDED
    assert sorted(p.delete_pods) == ["demo-rdzv", "demo-worker-0-0", "demo-worker-1-0"]


def test_success_needs_every_running_worker_done() -> None:
    w = started(replicas=3)
    w.set_pod("demo-worker-0-0", "Succeeded", exit_code=0)
    w.pods["demo-worker-2-0"]["status"] = {"phase": "Pending"}
    w.reconcile(T0)
    assert w.status["phase"] == "Running"
    assert w.condition(c.RUNNING)["reason"] == c.JOB_FINISHING
    w.set_pod("demo-worker-1-0", "Succeeded", exit_code=0)
    p = w.reconcile(T0 + timedelta(seconds=1))
    assert w.status["phase"] == "Succeeded"
    assert w.condition(c.SUCCEEDED)["reason"] == c.ALL_WORKERS_SUCCEEDED
    assert p.delete_pods == ("demo-worker-2-0", "demo-rdzv")  # the pending one never ran
    assert (w.status["restarts"], w.status["preemptions"]) == (0, 0)


def test_a_worker_that_died_after_every_node_finished_is_told_once_as_the_job_succeeds() -> None:
    """The launcher ended the pod 0 with its warning line (launch/agent.py): nothing is counted,
    the job Succeeds, and a Warning event quotes the worker's end, once."""
    w = started()
    warning = ("elastrain: warning: worker crashed: rank 0, killed by SIGABRT, after all 2 nodes "
               "finished training (every other node's workers exited 0)")
    w.set_pod("demo-worker-0-0", "Succeeded", exit_code=0, message=warning)
    w.set_pod("demo-worker-1-0", "Succeeded", exit_code=0)
    p = w.reconcile(T0 + timedelta(seconds=1))
    assert w.status["phase"] == "Succeeded"
    assert (w.status["restarts"], w.status["preemptions"]) == (0, 0)
    told = [e for e in p.events if e.reason == c.WORKER_CRASHED_AFTER_FINISH]
    assert [(e.type, e.message.split(": ", 1)[0]) for e in told] == [
        ("Warning", "demo-worker-0-0")], p.events
    assert "killed by SIGABRT, after all 2 nodes finished training" in told[0].message
    p = w.reconcile(T0 + timedelta(seconds=2))
    assert not [e for e in p.events if e.reason == c.WORKER_CRASHED_AFTER_FINISH]


def test_final_checkpoint_is_read_from_the_finished_workers_termination_message() -> None:
    """A trainer exits right after its final save, before any poll sees it: the final /progress
    it leaves as termination message makes status.lastCheckpoint the committed final one."""
    w = started()
    polled = parse_progress({"step": 60, "totalSteps": 60, "lastCheckpoint": {
        "step": 40, "uri": "s3://b/j/step-00000040", "time": "2026-01-01T00:00:00Z"}})
    w.reconcile(T0, progress=(polled,))
    assert w.status["lastCheckpoint"]["step"] == 40
    final = json.dumps({"step": 60, "totalSteps": 60, "loss": 1.5, "worldSize": 2,
                        "lastCheckpoint": {"step": 60, "uri": "s3://b/j/step-00000060",
                                           "time": "2026-01-01T00:00:05Z"}})
    for name in w.workers():
        w.set_pod(name, "Succeeded", exit_code=0, message=final)
    w.reconcile(T0 + timedelta(seconds=1))  # no poll this round: the pods are gone
    assert w.status["phase"] == "Succeeded"
    assert w.status["lastCheckpoint"]["step"] == 60
    assert w.status["progress"]["step"] == 60


def test_a_failed_workers_log_tail_is_not_read_as_progress() -> None:
    w = started()
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1, message='{"step": 99} Traceback ...')
    w.reconcile(T0)
    assert "lastCheckpoint" not in w.status and "progress" not in w.status


def test_ttl_deletes_the_finished_job() -> None:
    w = started(ttlSecondsAfterFinished=30)
    for name in w.workers():
        w.set_pod(name, "Succeeded", exit_code=0)
    w.reconcile(T0)
    assert not w.reconcile(T0 + timedelta(seconds=29)).delete_job
    assert w.reconcile(T0 + timedelta(seconds=30)).delete_job


def test_terminal_phase_is_sticky() -> None:
    w = started(restartPolicy={"maxRestarts": 0})
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1)
    w.reconcile(T0)
    w.job["spec"]["replicas"] = 3
    p = w.reconcile(T0 + timedelta(seconds=1))
    assert w.status["phase"] == "Failed" and p.create == ()


def test_invalid_spec_creates_nothing_and_says_why() -> None:
    w = World.new(nprocPerNode="auto")
    p = w.reconcile(T0)
    assert [m["kind"] for m in p.create] == []
    valid = w.condition(c.VALID)
    assert (valid["status"], valid["reason"]) == ("False", c.INVALID_SPEC)
    assert "spec.nprocPerNode" in valid["message"]
    assert any(e.reason == c.INVALID_SPEC for e in p.events)


def test_kubelet_config_error_is_reported_but_pods_stay() -> None:
    w = started()
    w.pods["demo-worker-0-0"]["status"] = {"phase": "Pending", "containerStatuses": [
        {"name": "trainer", "state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "creds" not found'}}}]}
    p = w.reconcile(T0)
    valid = w.condition(c.VALID)
    assert valid["status"] == "False" and 'secret "creds" not found' in valid["message"]
    assert p.delete_pods == () and w.status["restarts"] == 0


def test_job_being_deleted_only_releases_pods() -> None:
    w = started()
    w.job["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    p = w.plan(T0)
    assert sorted(p.release_pods) == ["demo-worker-0-0", "demo-worker-1-0"]
    assert p.create == () and p.delete_pods == ()


def test_progress_is_merged_from_the_furthest_worker() -> None:
    w = started()
    reports = tuple(r for r in (
        parse_progress({"step": 7, "totalSteps": 10, "loss": 2.0, "worldSize": 2,
                        "lastCheckpoint": {"step": 5, "uri": "s3://b/5",
                                           "time": "2026-01-01T00:00:00Z"}}),
        parse_progress({"step": 6, "totalSteps": 10, "loss": 2.1, "worldSize": 2,
                        "lastCheckpoint": None}),
        parse_progress({"nonsense": True})) if r is not None)
    w.reconcile(T0, progress=reports)
    assert w.status["progress"] == {"step": 7, "totalSteps": 10, "loss": 2.0, "worldSize": 2}
    assert w.status["lastCheckpoint"]["step"] == 5
    w.reconcile(T0, progress=())  # nobody answered: keep what we knew
    assert w.status["progress"]["step"] == 7


def test_recovery_is_measured_from_loss_to_full_size() -> None:
    w = started()
    w.set_pod("demo-worker-1-0", "Failed", disruption="PreemptionByScheduler")
    w.reconcile(T0)
    assert w.status["recoveringSince"] == "2026-01-01T00:00:00Z"
    w.run_all()
    p = w.reconcile(T0 + timedelta(seconds=7))
    assert p.recovered_after_seconds == 7.0
    assert "recoveringSince" not in w.status
    assert any(e.reason == c.RECOVERED for e in p.events)


def test_recovery_ignores_workers_that_were_never_scheduled() -> None:
    w = started(replicas=2)
    w.job["spec"]["replicas"] = 3  # worker 2 stays pending (unschedulable)
    w.reconcile(T0)
    w.set_pod("demo-worker-0-0", "Failed", disruption="DeletionByTaintManager")
    w.reconcile(T0)
    assert w.condition(c.RESTARTING)["status"] == "True"
    w.set_pod("demo-worker-0-1", "Running")
    p = w.reconcile(T0 + timedelta(seconds=4))
    assert p.recovered_after_seconds == 4.0
    assert w.condition(c.RESTARTING)["status"] == "False"
    assert w.condition(c.ALL_WORKERS_RUNNING)["reason"] == c.WORKERS_PENDING


def report(step: int, training_since: datetime | None = None,
           resumed_from: int | None = None) -> Any:
    doc: dict[str, Any] = {"step": step, "totalSteps": 100, "loss": 1.0, "worldSize": 2}
    if training_since is not None:
        doc["trainingSince"] = training_since.isoformat().replace("+00:00", "Z")
        doc["resumedFromStep"] = resumed_from
    return parse_progress(doc)


def training_resumed(p: Plan) -> list[str]:
    return [e.message for e in p.events if e.reason == c.TRAINING_RESUMED]


def test_progress_parses_the_resume_fields_and_accepts_older_trainers() -> None:
    new = report(21, T0 + timedelta(seconds=3), resumed_from=20)
    assert new is not None
    assert new.progress.resumed_from_step == 20
    assert new.progress.training_since == T0 + timedelta(seconds=3)
    old = report(21)
    assert old is not None and old.progress.training_since is None
    assert old.progress.resumed_from_step is None
    # A time without a zone cannot be compared with a loss's: not what the contract says.
    assert parse_progress({"step": 1, "trainingSince": "2026-01-01T00:00:03"}) is None


def test_an_inprocess_loss_is_counted_once_and_its_recovery_says_in_process() -> None:
    # The survivors keep running: no restart of theirs, one preemption for the lost pod only,
    # and the regroup's first step (trainingSince after the loss) closes the recovery.
    w = started(recovery={"mode": "InProcess"})
    w.set_pod("demo-worker-1-0", "Failed", disruption="PreemptionByScheduler")
    w.reconcile(T0 + timedelta(seconds=10))
    assert (w.status["preemptions"], w.status["restarts"]) == (1, 0)
    p = w.reconcile(T0 + timedelta(seconds=12),
                    progress=(report(21, T0 + timedelta(seconds=11.5), resumed_from=21),))
    assert w.status["lastRecovery"]["mode"] == "InProcess"
    assert training_resumed(p) == [
        "training resumed in process from step 21 1.5s after demo-worker-1-0 was lost"]
    w.run_all()
    w.reconcile(T0 + timedelta(seconds=13))
    assert (w.status["preemptions"], w.status["restarts"]) == (1, 0)


def test_training_recovery_is_recorded_once_per_loss() -> None:
    w = started(recovery={"mode": "Restart"})
    w.set_pod("demo-worker-1-0", "Failed", disruption="PreemptionByScheduler")
    w.reconcile(T0 + timedelta(seconds=10))  # the loss is counted at 00:00:10
    w.run_all()
    stale = w.reconcile(T0 + timedelta(seconds=15), progress=(report(20, T0, resumed_from=10),))
    assert stale.training_recovery is None and not training_resumed(stale)
    assert "lastRecovery" not in w.status
    resumed = (report(21, T0 + timedelta(seconds=22.5), resumed_from=20),
               report(21, T0 + timedelta(seconds=23), resumed_from=20))
    p = w.reconcile(T0 + timedelta(seconds=30), progress=resumed)
    assert p.training_recovery is not None and p.training_recovery.seconds == 12.5
    assert w.status["lastRecovery"] == {
        "lostAt": "2026-01-01T00:00:10Z", "trainingAt": "2026-01-01T00:00:22.500000Z",
        "seconds": 12.5, "kind": "Preempted", "pod": "demo-worker-1-0", "resumedFromStep": 20,
        "mode": "Restart"}
    assert training_resumed(p) == [
        "training resumed from step 20 12.5s after demo-worker-1-0 was lost"]
    again = w.reconcile(T0 + timedelta(seconds=31), progress=resumed)
    assert again.training_recovery is None and not training_resumed(again)
    assert w.status["lastRecovery"]["lostAt"] == "2026-01-01T00:00:10Z"
    # The next loss gets its own recovery.
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1)
    w.reconcile(T0 + timedelta(seconds=40))
    p = w.reconcile(T0 + timedelta(seconds=60),
                    progress=(report(30, T0 + timedelta(seconds=50)),))
    assert training_resumed(p) == [
        "training resumed from scratch 10.0s after demo-worker-0-0 was lost"]
    assert w.status["lastRecovery"]["kind"] == "Failed"


def test_a_loss_counted_late_is_dated_by_the_pod_and_still_gets_its_recovery() -> None:
    # An operator restarted mid-recovery counts the loss at 00:00:40, after the survivors
    # resumed at 00:00:20; the pod says it was disrupted at 00:00:10.
    w = started()
    w.set_pod("demo-worker-1-0", "Running", disruption="EvictionByEvictionAPI",
              at=T0 + timedelta(seconds=10))
    p = w.reconcile(T0 + timedelta(seconds=40),
                    progress=(report(30, T0 + timedelta(seconds=20), resumed_from=30),))
    assert w.status["recentLosses"][-1]["time"] == "2026-01-01T00:00:10Z"
    assert w.status["recoveringSince"] == "2026-01-01T00:00:10Z"
    assert p.training_recovery is not None
    assert (p.training_recovery.pod, p.training_recovery.seconds) == ("demo-worker-1-0", 10.0)
    # A stamp from a kubelet whose clock runs ahead never dates a loss after its counting.
    w.set_pod("demo-worker-0-0", "Failed", exit_code=1, at=T0 + timedelta(seconds=99))
    w.reconcile(T0 + timedelta(seconds=50))
    assert w.status["recentLosses"][-1]["time"] == "2026-01-01T00:00:50Z"


def test_a_recovery_waits_for_a_loss_counted_later_but_dated_earlier() -> None:
    w = started()
    w.set_pod("demo-worker-1-0", "Running", disruption="EvictionByEvictionAPI",
              at=T0 + timedelta(seconds=11))
    w.reconcile(T0 + timedelta(seconds=20))
    w.set_pod("demo-worker-0-0", "Running", disruption="EvictionByEvictionAPI",
              at=T0 + timedelta(seconds=10))
    w.reconcile(T0 + timedelta(seconds=21))
    assert w.status["recoveringSince"] == "2026-01-01T00:00:10Z"
    w.set_pod("demo-worker-1-1", "Running")
    assert w.reconcile(T0 + timedelta(seconds=30)).recovered_after_seconds is None
    w.set_pod("demo-worker-0-1", "Running")
    assert w.reconcile(T0 + timedelta(seconds=40)).recovered_after_seconds == 30.0


def test_training_recovery_is_measured_from_the_newest_of_several_losses() -> None:
    w = started()
    w.set_pod("demo-worker-1-0", "Failed", disruption="PreemptionByScheduler")
    w.reconcile(T0 + timedelta(seconds=10))
    w.set_pod("demo-worker-0-0", "Failed", disruption="PreemptionByScheduler")
    w.reconcile(T0 + timedelta(seconds=12))
    p = w.reconcile(T0 + timedelta(seconds=30),
                    progress=(report(5, T0 + timedelta(seconds=20), resumed_from=5),))
    assert p.training_recovery is not None
    assert (p.training_recovery.pod, p.training_recovery.seconds) == ("demo-worker-0-0", 8.0)


def test_old_trainers_without_the_resume_fields_record_no_recovery() -> None:
    w = started()
    w.set_pod("demo-worker-1-0", "Failed", disruption="PreemptionByScheduler")
    w.reconcile(T0 + timedelta(seconds=10))
    p = w.reconcile(T0 + timedelta(seconds=30), progress=(report(21),))
    assert p.training_recovery is None and not training_resumed(p)
    assert "lastRecovery" not in w.status and w.status["progress"]["step"] == 21
