"""The operator at scale (issue 11): N TrainingJobs x W workers created at once on a real
apiserver, measured against a plain client creating the same objects, in one run.

    python bench/operator_scale.py --jobs 1000 [--workers 4] [--churn-seconds 60] ...
    make bench-operator BENCH_ARGS="--jobs 1000"

Servers: tier A+ from hack/cluster.py (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler; data on /dev/shm) and one fake Ready Node with 110 pod slots and no kubelet: the
scheduler binds the first ~110 pods to it, every other pod stays Pending (Unschedulable, and the
scheduler keeps retrying them), no pod ever runs. A ServiceCIDR adds 10.100.0.0/16, since every
job's rendezvous Service takes a ClusterIP and the harness range is a /24.

Phases:
1. baseline: 16 threads of a plain client create the children the operator would create
   (W worker pods, the rendezvous store pod, two Services per job; rendered by the operator's own
   renderers, without owner reference and finalizer so they can be removed), then remove them;
2. create: the operator (`python -m elastrain_operator --standalone`) runs, 16 threads create the
   N jobs; the time until every child exists (seen on a watch) vs the baseline gives the ratio;
3. churn: one random live worker pod deleted per second (a preemption); replacement = the
   watch's ADDED of the next attempt of that job's slot, p50/p99 from the delete's return;
4. idle: operator and apiserver CPU with nothing happening;
5. peering: the operator stopped, two replicas with --peering (priorities 100 and 50) started,
   the same churn; then no slot may have two live pods and every job's status must count exactly
   the preemptions the benchmark caused (restarts 0), over both churn phases.
Operator peak RSS is its VmHWM. The result goes to bench/results/operator_scale.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import report
from s3_target import _hack_cluster

from elastrain_operator.k8s.client import Kube, Manifest, load_api_client, namespaced
from elastrain_operator.model.names import LABEL_ATTEMPT, LABEL_INDEX, LABEL_JOB, LABEL_ROLE
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.rendezvous import render_store_pod, render_store_service
from elastrain_operator.render.service import render_worker_service
from elastrain_operator.render.workers import render_worker_pod

ROOT = Path(__file__).resolve().parents[1]
NS, BASE_NS = "bench", "bench-base"
THREADS = 16
JOBS_PATH = f"/apis/elastrain.dev/v1alpha1/namespaces/{NS}/trainingjobs"


def job_manifest(name: str, workers: int) -> Manifest:
    return {"apiVersion": "elastrain.dev/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"image": "elastrain/trainer:dev", "replicas": workers,
                     "minReplicas": 1, "maxReplicas": workers}}


def baseline_children(name: str, workers: int) -> list[Manifest]:
    """What the operator creates for one job, as plain objects in the baseline namespace."""
    raw = job_manifest(name, workers)
    raw["metadata"].update(namespace=BASE_NS, uid=f"uid-{name}")
    job = TrainingJob.model_validate(raw)
    out = [render_worker_pod(job, i, 0) for i in range(workers)]
    out += [render_store_pod(job), render_worker_service(job), render_store_service(job)]
    for obj in out:
        obj["metadata"].pop("ownerReferences", None)
        obj["metadata"].pop("finalizers", None)
    return out


def path_of(obj: Manifest) -> str:
    plural = {"Pod": "pods", "Service": "services"}[obj["kind"]]
    return namespaced("v1", obj["metadata"]["namespace"], plural)


def parallel(fn: Callable[[Any], object], items: list[Any]) -> float:
    started = time.monotonic()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(fn, items))
    return time.monotonic() - started


# ----------------------------------------------------------------------------- the watch


@dataclass
class Seen:
    """What the benchmark's own watch of the namespace saw, with arrival times."""

    pods: dict[str, Manifest] = field(default_factory=dict)
    services: set[str] = field(default_factory=set)
    added: dict[tuple[str, int, int], float] = field(default_factory=dict)  # job, slot, attempt
    lock: threading.Lock = field(default_factory=threading.Lock)


def watch(kube: Kube, plural: str, seen: Seen, stop: threading.Event) -> None:
    path = namespaced("v1", NS, plural)
    while not stop.is_set():
        listed = kube.request("GET", path)
        rv = listed["metadata"]["resourceVersion"]
        for obj in listed.get("items") or []:
            _record(seen, plural, "ADDED", obj)
        try:
            for event in _stream(kube, f"{path}?watch=1&resourceVersion={rv}"
                                       "&timeoutSeconds=60", stop):
                _record(seen, plural, event["type"], event["object"])
        except Exception as err:  # a broken watch is re-listed
            print(f"watch {plural}: {err}; re-listing", file=sys.stderr)


def _stream(kube: Kube, path: str, stop: threading.Event) -> Iterator[Manifest]:
    serialized = kube.api.param_serialize(method="GET", resource_path=path,
                                          header_params={"Accept": "application/json"},
                                          auth_settings=["BearerToken"])
    response = kube.api.call_api(*serialized, _request_timeout=(10, 90)).response
    buffer = b""
    try:
        for chunk in response.stream(65536):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)
            if stop.is_set():
                return
    finally:
        response.release_conn()


def _record(seen: Seen, plural: str, kind: str, obj: Manifest) -> None:
    meta = obj.get("metadata") or {}
    name, labels = str(meta.get("name")), meta.get("labels") or {}
    now = time.monotonic()
    with seen.lock:
        if plural == "services":
            (seen.services.discard if kind == "DELETED" else seen.services.add)(name)
            return
        if kind == "DELETED":
            seen.pods.pop(name, None)
            return
        seen.pods[name] = obj
        if labels.get(LABEL_ROLE) == "worker" and LABEL_INDEX in labels:
            slot = (labels[LABEL_JOB], int(labels[LABEL_INDEX]), int(labels[LABEL_ATTEMPT]))
            seen.added.setdefault(slot, now)


def wait(what: str, check: Callable[[], bool], timeout: float, every: float = 0.2) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(every)
    return time.monotonic() - started


# --------------------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Operator:
    proc: subprocess.Popen[bytes]
    metrics_port: int
    log: Path

    started: typing.ClassVar[list[Operator]] = []

    @classmethod
    def start(cls, kubeconfig: str, log: Path, *extra: str, src: str = "") -> Operator:
        port = free_port()
        env = {**os.environ, "KUBECONFIG": kubeconfig}
        if src:
            env["PYTHONPATH"] = f"{src}/operator"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "elastrain_operator", "--namespace", NS,
                 "--metrics-port", str(port), *(extra or ("--standalone",))],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        op = cls(proc, port, log)
        cls.started.append(op)
        return op

    def reconciles(self) -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=5) as rsp:
                text = rsp.read().decode()
        except OSError:
            return 0.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("elastrain_operator_reconcile_total{"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @classmethod
    def stop_all(cls) -> None:
        for op in cls.started:
            op.stop()


def settle(op: Operator, quiet_seconds: float, timeout: float) -> float:
    """Wait until the operator has made no reconcile round for quiet_seconds."""
    started, last, since = time.monotonic(), -1.0, time.monotonic()
    while time.monotonic() - since < quiet_seconds:
        if time.monotonic() - started > timeout:
            break
        now = op.reconciles()
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(1.0)
    return time.monotonic() - started


# ----------------------------------------------------------------------------- phases


def phase_baseline(kube: Kube, names: list[str], workers: int) -> float:
    bodies = [obj for name in names for obj in baseline_children(name, workers)]
    seconds = parallel(lambda obj: kube.create(path_of(obj), obj), bodies)
    parallel(lambda obj: kube.delete(f"{path_of(obj)}/{obj['metadata']['name']}",
                                     body={"gracePeriodSeconds": 0}), bodies)
    wait("baseline objects gone", lambda: not kube.list(namespaced("v1", BASE_NS, "pods")),
         timeout=300, every=2)
    return seconds


def live_workers(seen: Seen) -> list[tuple[str, str, int, int]]:
    with seen.lock:
        pods = list(seen.pods.values())
    out = []
    for pod in pods:
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        if labels.get(LABEL_ROLE) == "worker" and not meta.get("deletionTimestamp"):
            out.append((meta["name"], labels[LABEL_JOB], int(labels[LABEL_INDEX]),
                        int(labels[LABEL_ATTEMPT])))
    return out


def churn(kube: Kube, seen: Seen, seconds: float, rate: float, rng: random.Random,
          deleted: dict[str, int]) -> list[float]:
    """Delete one random live worker per 1/rate s; returns replacement latencies (s)."""
    pending: list[tuple[tuple[str, int, int], float]] = []
    started = time.monotonic()
    for n in range(round(seconds * rate)):
        time.sleep(max(0.0, started + n / rate - time.monotonic()))
        name, job, index, attempt = rng.choice(live_workers(seen))
        kube.delete(namespaced("v1", NS, "pods", name))
        gone = time.monotonic()
        deleted[job] = deleted.get(job, 0) + 1
        pending.append(((job, index, attempt), gone))

    def replaced(slot: tuple[str, int, int]) -> float | None:
        job, index, attempt = slot
        with seen.lock:
            times = [t for (j, i, a), t in seen.added.items()
                     if j == job and i == index and a > attempt]
        return min(times) if times else None

    wait("every deleted worker replaced",
         lambda: all(replaced(slot) is not None for slot, _ in pending), timeout=300, every=0.5)
    return [max(0.0, (replaced(slot) or 0.0) - gone) for slot, gone in pending]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[math.ceil(0.99 * len(ordered)) - 1]  # nearest rank
    return {"n": len(values), "p50": round(statistics.median(ordered), 3),
            "p99": round(p99, 3), "max": round(ordered[-1], 3)}


def idle(op: Operator, apiserver_pid: int, seconds: float) -> dict[str, float]:
    before = (cpu_seconds(op.proc.pid), cpu_seconds(apiserver_pid), op.reconciles())
    time.sleep(seconds)
    after = (cpu_seconds(op.proc.pid), cpu_seconds(apiserver_pid), op.reconciles())
    # The apiserver's load without the operator, the same objects present: the operator is
    # stopped (SIGSTOP keeps its watch connections open) for as long again.
    os.kill(op.proc.pid, signal.SIGSTOP)
    try:
        alone = cpu_seconds(apiserver_pid)
        time.sleep(seconds)
        alone = cpu_seconds(apiserver_pid) - alone
    finally:
        os.kill(op.proc.pid, signal.SIGCONT)
    return {"seconds": seconds,
            "operator_core_fraction": round((after[0] - before[0]) / seconds, 4),
            "apiserver_core_fraction": round((after[1] - before[1]) / seconds, 4),
            "apiserver_core_fraction_operator_stopped": round(alone / seconds, 4),
            "reconcile_rounds_per_second": round((after[2] - before[2]) / seconds, 2)}


def check_counts(kube: Kube, seen: Seen, deleted: dict[str, int], workers: int) -> dict[str, Any]:
    jobs = kube.list(JOBS_PATH)
    wrong = {}
    for job in jobs:
        name, status = job["metadata"]["name"], job.get("status") or {}
        got = (int(status.get("preemptions", 0)), int(status.get("restarts", 0)))
        if got != (deleted.get(name, 0), 0):
            wrong[name] = {"preemptions": got[0], "restarts": got[1],
                           "deleted": deleted.get(name, 0)}
    slots: dict[tuple[str, int], int] = {}
    for _, job_name, index, _ in live_workers(seen):
        slots[(job_name, index)] = slots.get((job_name, index), 0) + 1
    duplicates = sum(1 for n in slots.values() if n > 1)
    short = len(jobs) * workers - len(slots)
    return {"jobs": len(jobs), "deleted": sum(deleted.values()),
            "counted_preemptions": sum(int((j.get("status") or {}).get("preemptions", 0))
                                       for j in jobs),
            "jobs_counted_wrong": len(wrong), "wrong_examples": dict(list(wrong.items())[:5]),
            "slots_with_two_live_pods": duplicates, "slots_without_live_pod": short}


# ------------------------------------------------------------------------------- main


def run(args: argparse.Namespace, state: Any, workdir: Path) -> dict[str, Any]:
    kubeconfig = state.kubeconfig
    os.environ["KUBECONFIG"] = kubeconfig
    kube = Kube(load_api_client(pool_size=THREADS + 4))
    apiserver = next(p.pid for p in state.procs if p.name == "kube-apiserver")
    for ns in (NS, BASE_NS):
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                            "metadata": {"name": ns}})
    kube.create("/apis/networking.k8s.io/v1/servicecidrs",
                {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                 "metadata": {"name": "bench-wide"}, "spec": {"cidrs": ["10.100.0.0/16"]}})
    subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "apply", "--server-side", "-f",
                    str(ROOT / "crds")], check=True, capture_output=True)
    subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "wait", "--for=condition=Ready",
                    "servicecidr/bench-wide", "--timeout=60s"], check=True, capture_output=True)
    names = [f"job-{i:04d}" for i in range(args.jobs)]
    children = args.jobs * (args.workers + 3)
    result: dict[str, Any] = {"jobs": args.jobs, "workers_per_job": args.workers,
                              "children": children, "cpus": os.cpu_count(),
                              "operator_src": args.operator_src or "this checkout"}

    result["baseline_seconds"] = round(phase_baseline(kube, names, args.workers), 2)
    print(f"baseline: {children} objects in {result['baseline_seconds']} s", flush=True)

    seen, stop = Seen(), threading.Event()
    for plural in ("pods", "services"):
        threading.Thread(target=watch, args=(kube, plural, seen, stop), daemon=True).start()
    op = Operator.start(kubeconfig, workdir / "operator.log", src=args.operator_src)
    wait("operator metrics", lambda: _port_open(op.metrics_port), timeout=60)
    time.sleep(3)  # kopf lists and starts its watches
    cpu0 = cpu_seconds(op.proc.pid)
    started = time.monotonic()
    parallel(lambda n: kube.create(JOBS_PATH, job_manifest(n, args.workers)), names)
    created = time.monotonic() - started

    def count() -> int:
        with seen.lock:
            return len(seen.pods) + len(seen.services)
    marks: dict[str, float] = {}

    def progress() -> bool:
        n = count()
        for frac in (0.1, 0.5, 0.9):
            if n >= frac * children and str(frac) not in marks:
                marks[str(frac)] = round(time.monotonic() - started, 2)
        return n >= children
    wait("every child", progress, timeout=3600)
    all_seconds = time.monotonic() - started
    result["create"] = {"jobs_created_seconds": round(created, 2),
                        "all_children_seconds": round(all_seconds, 2), "marks": marks,
                        "ratio": round(result["baseline_seconds"] / all_seconds, 3),
                        "operator_cpu_seconds": round(cpu_seconds(op.proc.pid) - cpu0, 1)}
    print(f"create: {result['create']}", flush=True)
    result["create"]["settle_seconds"] = round(settle(op, 10, 600), 1)

    rng, deleted = random.Random(11), {}
    latencies = churn(kube, seen, args.churn_seconds, args.churn_rate, rng, deleted)
    result["churn"] = percentiles(latencies)
    print(f"churn: {result['churn']}", flush=True)
    settle(op, 5, 120)
    result["idle"] = idle(op, apiserver, args.idle_seconds)
    print(f"idle: {result['idle']}", flush=True)
    result["operator_peak_rss_mb"] = round(peak_rss_mb(op.proc.pid), 1)
    result["operator_cpu_seconds_total"] = round(cpu_seconds(op.proc.pid), 1)
    result["counts_single"] = check_counts(kube, seen, deleted, args.workers)
    op.stop()

    if args.peering:
        result["peering"] = phase_peering(args, kube, kubeconfig, workdir, seen, deleted, rng)
    stop.set()
    return result


def phase_peering(args: argparse.Namespace, kube: Kube, kubeconfig: str, workdir: Path,
                  seen: Seen, deleted: dict[str, int], rng: random.Random) -> dict[str, Any]:
    common = ("--peering", "elastrain", "--peering-lifetime", "30")
    high = Operator.start(kubeconfig, workdir / "op-high.log", *common, "--priority", "100",
                          src=args.operator_src)
    low = Operator.start(kubeconfig, workdir / "op-low.log", *common, "--priority", "50",
                         src=args.operator_src)
    try:
        wait("the high replica resumes", lambda: "Resuming operations" in
             high.log.read_text(errors="replace"), timeout=120)
        time.sleep(5)
        out: dict[str, Any] = {"resume_settle_seconds": round(settle(high, 10, 900), 1)}
        latencies = churn(kube, seen, args.churn_seconds, args.churn_rate, rng, deleted)
        out["churn"] = percentiles(latencies)
        settle(high, 5, 120)
        time.sleep(3)
        out["counts"] = check_counts(kube, seen, deleted, args.workers)
        out["low_replica_rounds"] = low.reconciles()
        out["high_peak_rss_mb"] = round(peak_rss_mb(high.proc.pid), 1)
        print(f"peering: {out}", flush=True)
        return out
    finally:
        high.stop()
        low.stop()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4, help="workers per job")
    parser.add_argument("--churn-seconds", type=float, default=60.0)
    parser.add_argument("--churn-rate", type=float, default=1.0, help="deletions per second")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--no-peering", dest="peering", action="store_false")
    parser.add_argument("--operator-src", default="",
                        help="a checkout whose operator/ to run instead (e.g. a git worktree "
                             "of an older commit, to measure it the same way)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/operator_scale.json")
    args = parser.parse_args(argv)
    cluster = _hack_cluster()
    workdir = Path(tempfile.mkdtemp(prefix="elastrain-opscale-"))
    state = cluster.up(workdir / "cluster", tier="a+", s3=False, die_with_parent=True)
    try:
        result = run(args, state, workdir)
    finally:
        Operator.stop_all()
        cluster.down(workdir / "cluster")
    return report.write(args.out, result, result, workdir)


if __name__ == "__main__":
    sys.exit(main())
