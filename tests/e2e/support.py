"""What the e2e scenarios share: kubectl, polling, a TrainingJob builder, the trainers' own
records collected from their pods' logs, and reading counters from status, events and metrics.

The trainers' records (one JSON object per stdout line, elastrain_trainer.events) are the
ground truth for training continuity: `LogCollector` follows every worker pod's log from the
moment it starts until its container ends, so the records of an evicted pod are kept after the
pod object is gone.

Both recovery modes (spec.recovery.mode, docs/recovery.md) are driven the same way; what differs
is what a recovery leaves in the records: in Restart mode every worker process starts again and
the group resumes from a checkpoint (a `resumed` record), in InProcess mode the survivors keep
their processes and change generation (a `regroup` record), so the measures below come in both
shapes, and `processes` reads the survivors' trainer processes from the node itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import yaml

T = TypeVar("T")
Manifest = dict[str, Any]
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "runs" / "e2e"


@dataclass(frozen=True)
class Kubectl:
    kubeconfig: Path

    def __call__(self, *args: str, check: bool = True, input_text: str | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
                              input=input_text, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json").stdout)

    def apply(self, manifest: Manifest) -> None:
        self("apply", "-f", "-", input_text=json.dumps(manifest))


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0,
             interval: float = 0.5) -> T:
    """Poll until probe returns something truthy; fail naming what never happened."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return cast(T, last)
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


# ------------------------------------------------------------------------------------ the job


EXAMPLE_JOB = ROOT / "examples" / "kind" / "cpu-gloo.yaml"


def make_job(name: str, namespace: str, *, image: str, s3_endpoint: str, bucket: str,
             steps: int = 240, replicas: int = 3, interval_steps: int = 20,
             step_sleep: float = 0.25, grace_seconds: int = 60, **spec: Any) -> Manifest:
    """The kind example (examples/kind/cpu-gloo.yaml: DDP over gloo, the tiny GPT, checkpoints
    to MinIO), as the issue's e2e job: 3 workers, min 2. What differs from kind is only what a
    one-node cluster needs: no spot/on-demand node selectors, the node's own MinIO and images."""
    job: Manifest = yaml.safe_load(EXAMPLE_JOB.read_text())
    job["metadata"] = {"name": name, "namespace": namespace}
    s = job["spec"]
    s.update(image=image, replicas=replicas, minReplicas=2, maxReplicas=3,
             terminationGracePeriodSeconds=grace_seconds)
    s["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"memory": "1536Mi"}}
    s["trainer"].update(steps=steps, seqLen=64)
    # Paces the tiny model so that events land mid-run on a 2-core machine.
    s["env"] = [{"name": "ELASTRAIN_STEP_SLEEP_SECONDS", "value": str(step_sleep)}]
    s["checkpoint"].update(uri=f"s3://{bucket}/{namespace}/{name}", endpoint=s3_endpoint,
                           intervalSteps=interval_steps)
    s["restartPolicy"] = {"maxRestarts": 3, "backoffSeconds": 1}
    # The images were imported into containerd; there is no registry to pull from.
    s["template"] = {"imagePullPolicy": "Never"}
    s.pop("rendezvous", None)
    s.pop("ttlSecondsAfterFinished", None)
    s.update(spec)
    return job


# The restricted Pod Security level, as a container of a test's own pod meets it (the job
# namespaces enforce it); 65532 is the user the project's images run as.
RESTRICTED_POD_SECURITY: Manifest = {"runAsNonRoot": True, "runAsUser": 65532,
                                     "runAsGroup": 65532,
                                     "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER_SECURITY: Manifest = {"allowPrivilegeEscalation": False,
                                           "capabilities": {"drop": ["ALL"]},
                                           "runAsNonRoot": True, "runAsUser": 65532,
                                           "seccompProfile": {"type": "RuntimeDefault"}}


def restricted_pod(name: str, namespace: str, *, image: str, command: list[str],
                   labels: dict[str, str] | None = None, **spec: Any) -> Manifest:
    """A test's own pod (a stand-in, a probe) that a restricted namespace admits."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
            "spec": {"restartPolicy": "Never", "securityContext": RESTRICTED_POD_SECURITY,
                     "containers": [{"name": name, "image": image, "imagePullPolicy": "Never",
                                     "command": command,
                                     "securityContext": RESTRICTED_CONTAINER_SECURITY}],
                     **spec}}


# ------------------------------------------------------------------------------ trainer records


class LogCollector:
    """Follows the trainer container's log of every pod matching a selector, as pods appear."""

    def __init__(self, kubectl: Kubectl, namespace: str, selector: str, out: Path) -> None:
        self.kubectl, self.ns, self.selector, self.out = kubectl, namespace, selector, out
        self.records: list[dict[str, Any]] = []
        self._followed: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        out.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> LogCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        while not self._stop.is_set():
            done = self.kubectl("get", "pods", "-n", self.ns, "-l", self.selector, "-o", "json",
                                check=False)
            if done.returncode == 0:
                for pod in json.loads(done.stdout)["items"]:
                    name = pod["metadata"]["name"]
                    statuses = pod.get("status", {}).get("containerStatuses") or []
                    started = any(s.get("state", {}).get("running") or
                                  s.get("state", {}).get("terminated") for s in statuses)
                    if started and name not in self._followed:
                        self._followed.add(name)
                        threading.Thread(target=self._follow, args=(name,), daemon=True).start()
            self._stop.wait(0.5)

    def _follow(self, pod: str) -> None:
        from elastrain_trainer.events import parse_line

        argv = ["kubectl", "--kubeconfig", str(self.kubectl.kubeconfig), "logs", "-f", "-n",
                self.ns, pod, "-c", "trainer"]
        with (self.out / f"{pod}.log").open("w") as raw, subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                raw.write(line)
                raw.flush()
                record = parse_line(line)
                if record is not None:
                    with self._lock:
                        self.records.append({**record, "pod": pod})

    def events(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return sorted((r for r in self.records if r["event"] == kind),
                          key=lambda r: float(r["time"]))

    def max_step(self) -> int:
        return max((int(r["step"]) for r in self.events("step")), default=0)

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        wait_for(f"training step {step}", lambda: self.max_step() >= step, timeout=timeout)


def group_starts(collector: LogCollector, since: float) -> list[dict[str, Any]]:
    """A worker group's starts after `since`, in time order: a resume from a checkpoint, or a
    fresh start (a group that restarted before anything was committed)."""
    return sorted((r for kind in ("resumed", "fresh_start") for r in collector.events(kind)
                   if float(r["time"]) > since), key=lambda r: float(r["time"]))


def first_step_after(collector: LogCollector, since: float) -> dict[str, Any] | None:
    """The first step record trained after a group's start that happened after `since` (epoch
    s)."""
    resumes = group_starts(collector, since)
    if not resumes:
        return None
    resumed_at = float(resumes[0]["time"])
    steps = [r for r in collector.events("step") if float(r["time"]) >= resumed_at]
    return steps[0] if steps else None


def steps_lost_at(collector: LogCollector, since: float) -> int:
    """Steps trained before `since` that the resume after it trained again.

    "Before" is the last step logged before `since` (events() is in time order), not the
    highest: after an earlier fault that lost steps (a SIGKILL), the group retrains them, so
    the highest step ever logged can be ahead of where training stood when this fault came.
    """
    earlier = [int(r["step"]) for r in collector.events("step") if float(r["time"]) <= since]
    before = earlier[-1] if earlier else 0
    resumes = group_starts(collector, since)
    return max(0, before - int(resumes[0].get("step", 0))) if resumes else before


def first_step_after_change(collector: LogCollector, since: float) -> dict[str, Any] | None:
    """InProcess mode: the first step trained after the first generation change (`regroup`) or
    checkpoint resume (`resumed`: a start after the whole group stopped) that came after `since`."""
    marks = [float(r["time"]) for kind in ("regroup", "resumed")
             for r in collector.events(kind) if float(r["time"]) > since]
    if not marks:
        return None
    steps = [r for r in collector.events("step") if float(r["time"]) >= min(marks)]
    return steps[0] if steps else None


def steps_retrained(collector: LogCollector, since: float) -> int:
    """Steps that had been trained and were trained again after `since`, whatever undid them (a
    checkpoint resume, a generation healed at an older step): for each step record after
    `since`, how many higher steps had already been logged. Only records from the last step
    before `since` on count, so steps an earlier fault lost and retrained are not counted here.
    """
    steps = collector.events("step")
    start = max((i for i, r in enumerate(steps) if float(r["time"]) <= since), default=0)
    lost, highest = 0, 0
    for r in steps[start:]:
        if float(r["time"]) > since:
            lost = max(lost, highest - (int(r["step"]) - 1))
        highest = max(highest, int(r["step"]))
    return lost


def evict(kubectl: Kubectl, namespace: str, pod: str) -> float:
    """Evicts a pod through the Eviction API (as a drain or a spot handler does); returns when."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace}}
    at = time.time()
    kubectl("create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", "-f", "-",
            input_text=json.dumps(body))
    return at


# spec.recovery.mode values, and the ids the scenarios run under.
RESTART, INPROCESS = "Restart", "InProcess"
RECOVERY_MODES = {"restart": RESTART, "inprocess": INPROCESS}


def recovery_spec(mode: str) -> Manifest:
    """The TrainingJob spec fields for a recovery mode: InProcess is what an unset mode picks
    for the built-in trainer and Session scripts, so its job leaves the field out, as a user's
    would (the default's path is the one tested); Restart is set."""
    return {} if mode == INPROCESS else {"recovery": {"mode": mode}}


# The node's containerd state (hack/cluster.py --tier node), where each task's init PID is.
CONTAINERD_TASKS = Path("/run/elastrain-node/containerd/io.containerd.runtime.v2.task/k8s.io")


def container_pid(kubectl: Kubectl, namespace: str, pod: str) -> int:
    """The host PID of the pod's trainer container's first process (the torchrun agent)."""
    status = kubectl.json("get", "pod", pod, "-n", namespace)["status"]
    (trainer,) = [c for c in status["containerStatuses"] if c["name"] == "trainer"]
    container_id = trainer["containerID"].split("://", 1)[1]
    return int((CONTAINERD_TASKS / container_id / "init.pid").read_text())


def child_processes(pid: int) -> frozenset[tuple[int, int]]:
    """(PID, start time in clock ticks) of each live child of `pid`: the agent's worker
    processes. The start time tells a new process from an old one that had the same PID."""
    children = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # fields[0] is field 3 of proc(5)
        if int(fields[1]) == pid:
            children.add((int(entry.name), int(fields[19])))
    return frozenset(children)


def process_tree(root: int) -> list[int]:
    """`root` and every process under it (the container's: torch starts its workers in
    sessions of their own, so a process group would miss them)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        tree += kids
        frontier = kids
    return tree


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass(frozen=True)
class Incarnation:
    """One worker pod's trainer as the node runs it: the pod object, how often the kubelet
    restarted its container, and the worker processes its torchrun agent runs."""

    uid: str
    restart_count: int
    workers: frozenset[tuple[int, int]]


@dataclass
class Training:
    """One long-running TrainingJob as the preemption scenarios and the real-node recovery
    benchmark (bench/recovery_node.py) drive it: its status, its live worker pods, and when it
    is back at full size and training."""

    k: Kubectl
    ns: str
    job: str
    logs: LogCollector
    mode: str = RESTART

    @staticmethod
    def worker_selector(job: str) -> str:
        return f"elastrain.dev/job-name={job},elastrain.dev/role=worker"

    def status(self) -> dict[str, Any]:
        return job_status(self.k, self.ns, self.job)

    def workers(self) -> list[dict[str, Any]]:
        pods = self.k.json("get", "pods", "-n", self.ns, "-l",
                           self.worker_selector(self.job))["items"]
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def worker(self, index: int) -> str:
        for pod in self.workers():
            if pod["metadata"]["labels"]["elastrain.dev/worker-index"] == str(index):
                return str(pod["metadata"]["name"])
        pytest.fail(f"no live pod for worker {index}")

    def at_full_size(self, replicas: int = 3) -> bool:
        status = self.status()
        return bool(status.get("readyReplicas") == replicas and status.get("phase") == "Running"
                    and not status.get("recoveringSince"))

    def settle(self, replicas: int = 3, ranks: int = 1) -> None:
        """Full size, Ready, and training: a step trained after every current pod started
        (`ranks` per pod: the world is replicas x ranks)."""
        wait_for(f"{replicas} ready workers", lambda: self.at_full_size(replicas), timeout=240)
        mark = time.time()
        wait_for("a training step at full size",
                 lambda: any(float(r["time"]) > mark and r.get("world_size") == replicas * ranks
                             for r in self.logs.events("step")), timeout=180)

    def evict(self, pod: str) -> float:
        return evict(self.k, self.ns, pod)

    def resumed_after(self, since: float, timeout: float = 240) -> dict[str, Any]:
        return wait_for("a training step after the resume",
                        lambda: first_step_after(self.logs, since), timeout=timeout)

    def recovered_after(self, since: float, timeout: float = 240) -> dict[str, Any]:
        """The first step trained after the recovery from a loss at `since`, in this job's
        mode: after the resume (Restart) or the next generation (InProcess)."""
        if self.mode == RESTART:
            return self.resumed_after(since, timeout)
        return wait_for("a training step after the regroup",
                        lambda: first_step_after_change(self.logs, since), timeout=timeout)

    def processes(self) -> dict[str, Incarnation]:
        """Every live worker pod's trainer incarnation, read from the node's /proc."""
        out = {}
        for pod in self.workers():
            name = pod["metadata"]["name"]
            statuses = pod.get("status", {}).get("containerStatuses") or []
            trainer: dict[str, Any] = next((c for c in statuses if c["name"] == "trainer"), {})
            if not trainer.get("state", {}).get("running"):
                continue  # not started yet (a replacement), or ending
            out[name] = Incarnation(uid=pod["metadata"]["uid"],
                                    restart_count=int(trainer.get("restartCount", 0)),
                                    workers=child_processes(container_pid(self.k, self.ns, name)))
        return out

    def counters(self) -> tuple[int, int]:
        """(preemptions, restarts) from the job's status."""
        s = self.status()
        return int(s.get("preemptions", 0)), int(s.get("restarts", 0))

    def counted_once_in_process(self, before: tuple[int, int], pod: str,
                                at: float) -> dict[str, Any]:
        """An eviction of `pod` at `at` in InProcess mode: one preemption, no restart, counted
        once (a second count would come with the next reconcile), no step retrained, the
        event, and status.lastRecovery naming the pod and the mode. Returns lastRecovery."""
        wait_for("the preemption counted", lambda: self.counters()[0] == before[0] + 1)
        time.sleep(5)
        assert self.counters() == (before[0] + 1, before[1])
        assert steps_retrained(self.logs, at) == 0
        assert "WorkerPreempted" in event_reasons(self.k, self.ns, self.job)
        recovery: dict[str, Any] = self.status().get("lastRecovery") or {}
        assert recovery.get("pod") == pod and recovery.get("mode") == INPROCESS, recovery
        return recovery


# ----------------------------------------------------------------------------------- counters


def job_status(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    doc = kubectl.json("get", "trainingjob", name, "-n", namespace)
    return cast(dict[str, Any], doc.get("status", {}))


def event_reasons(kubectl: Kubectl, namespace: str, name: str) -> list[str]:
    doc = kubectl.json("get", "events", "-n", namespace,
                       "--field-selector", f"involvedObject.name={name}")
    out: list[str] = []
    for event in doc["items"]:
        out += [event["reason"]] * int(event.get("count") or 1)
    return out


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text exposition as {sample name with labels: value}."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def record_recovery(scenario: str, seconds: float, **details: Any) -> None:
    """Appends one recovery (worker lost -> first training step after resume) to the JSON file
    of this run and prints it into the test output."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / "recovery.json"
    doc = json.loads(path.read_text()) if path.exists() else []
    doc.append({"scenario": scenario, "recovery_seconds": round(seconds, 2), **details})
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"recovery[{scenario}]: {seconds:.1f} s {details}")
