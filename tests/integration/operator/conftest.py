"""Fixtures for the operator against the real apiserver: the operator as a subprocess (so tests
can SIGKILL it), a fake kubelet, and a `Cluster` helper that drives pod status like a kubelet.

No kubelet runs here. The scheduler binds pods to the fake node; a bound pod that is deleted
stays Terminating until a kubelet confirms, so `FakeKubelet` confirms every deletion (a DELETE
with grace 0, which still waits for finalizers, exactly like the real thing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain_operator.k8s.client import Kube, namespaced
from elastrain_operator.model.names import LABEL_JOB, LABEL_ROLE
from tests.integration.conftest import kubectl, wait_established
from tests.integration.waiting import wait_for as wait_for

ROOT = Path(__file__).resolve().parents[3]
PEERING_CRDS = ROOT / "crds" / "kopf-peering.yaml"
GROUP_VERSION = "elastrain.dev/v1alpha1"
Manifest = dict[str, Any]


class Cluster:
    """The test namespace through the operator's own JSON client, plus kubelet-like verbs."""

    def __init__(self, kube: Kube, namespace: str, kube_fixture: Any) -> None:
        self.kube = kube
        self.ns = namespace
        self.kube_fixture = kube_fixture
        self.kubelet: FakeKubelet | None = None  # the cluster fixture's

    # --- jobs ---------------------------------------------------------------------------------
    def job_path(self, name: str = "") -> str:
        return namespaced(GROUP_VERSION, self.ns, "trainingjobs", name)

    def create_job(self, name: str = "demo", **spec: Any) -> Manifest:
        """A job in Restart mode unless `spec` says otherwise: these tests drive pod status by
        hand and were written for torchrun's rendezvous (an unset mode would be InProcess for
        the built-in trainer; the e2e tier runs that default on a real node)."""
        body = {"apiVersion": GROUP_VERSION, "kind": "TrainingJob", "metadata": {"name": name},
                "spec": {"image": "trainer:dev", "replicas": 2, "minReplicas": 1,
                         "maxReplicas": 6, "recovery": {"mode": "Restart"}, **spec}}
        return self.kube.request("POST", self.job_path(), body=body)

    def job(self, name: str = "demo") -> Manifest | None:
        return self.kube.get(self.job_path(name))

    def status(self, name: str = "demo") -> Manifest:
        job = self.job(name)
        return dict((job or {}).get("status") or {})

    def condition(self, kind: str, name: str = "demo") -> Manifest:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == kind), {})

    def patch_spec(self, name: str = "demo", **spec: Any) -> None:
        self.kube.patch(self.job_path(name), {"spec": spec})

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return kubectl(self.kube_fixture, "-n", self.ns, *args, check=check)

    # --- pods ---------------------------------------------------------------------------------
    def pods(self, job: str = "demo", role: str = "worker", *,
             live: bool = True) -> dict[str, Manifest]:
        items = self.kube.list(namespaced("v1", self.ns, "pods"),
                               labels=f"{LABEL_JOB}={job},{LABEL_ROLE}={role}")
        return {p["metadata"]["name"]: p for p in items
                if not (live and p["metadata"].get("deletionTimestamp"))}

    def worker_names(self, job: str = "demo") -> list[str]:
        return sorted(self.pods(job))

    def wait_workers(self, names: list[str], job: str = "demo", timeout: float = 30) -> None:
        wait_for(f"workers {names}", lambda: self.worker_names(job) == sorted(names) or None,
                 timeout)

    def pod_status(self, name: str, status: Manifest) -> None:
        self.kube.request("PATCH", namespaced("v1", self.ns, "pods", name) + "/status",
                          body={"status": status},
                          content_type="application/strategic-merge-patch+json")

    def run(self, name: str, *, ip: str = "127.0.0.1", ready: bool = True) -> None:
        self.pod_status(name, {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                               "conditions": [{"type": "Ready",
                                               "status": "True" if ready else "False"}],
                               "containerStatuses": [_container(running=True)]})

    def run_all(self, job: str = "demo") -> None:
        for name, pod in self.pods(job).items():
            if (pod.get("status") or {}).get("phase") in (None, "Pending"):
                self.run(name)

    def exit(self, name: str, code: int, *, reason: str = "Error",
             disruption: str | None = None, message: str = "") -> None:
        status: Manifest = {"phase": "Succeeded" if code == 0 and not disruption else "Failed",
                            "containerStatuses": [_container(exit_code=code, reason=reason,
                                                             message=message)],
                            "conditions": [{"type": "Ready", "status": "False"}]}
        if disruption:
            status["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                         "reason": disruption, "message": "test"})
        self.pod_status(name, status)

    def evict(self, name: str) -> None:
        self.kube.request("POST", namespaced("v1", self.ns, "pods", name) + "/eviction",
                          body={"apiVersion": "policy/v1", "kind": "Eviction",
                                "metadata": {"name": name, "namespace": self.ns}})

    def delete_pod(self, name: str) -> None:
        self.kube.delete(namespaced("v1", self.ns, "pods", name))

    def events(self, reason: str, name: str = "demo") -> list[Manifest]:
        items = self.kube.list(namespaced("v1", self.ns, "events"))
        return [e for e in items if e.get("reason") == reason
                and e["involvedObject"].get("name") == name
                and e["involvedObject"].get("kind") == "TrainingJob"]


def _container(*, running: bool = False, exit_code: int | None = None,
               reason: str = "", message: str = "") -> Manifest:
    state: Manifest = ({"running": {"startedAt": "2026-01-01T00:00:00Z"}} if running else
                       {"terminated": {"exitCode": exit_code, "reason": reason,
                                       "message": message,
                                       "startedAt": "2026-01-01T00:00:00Z",
                                       "finishedAt": "2026-01-01T00:00:01Z"}})
    return {"name": "trainer", "image": "trainer:dev", "imageID": "", "ready": running,
            "restartCount": 0, "state": state}


class FakeKubelet:
    """Confirms the deletion of bound pods, as a kubelet does once their containers stopped;
    never for a pod in `dark` (its node stopped answering: only a force-delete removes it)."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.ns = kube, namespace
        self.dark: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        confirmed: set[str] = set()
        while not self.stop.wait(0.3):
            try:
                pods = self.kube.list(namespaced("v1", self.ns, "pods"))
            except Exception:
                continue
            for pod in pods:
                meta = pod["metadata"]
                if meta.get("deletionTimestamp") and meta["uid"] not in confirmed \
                        and meta["name"] not in self.dark:
                    try:
                        self.kube.delete(namespaced("v1", self.ns, "pods", meta["name"]),
                                         body={"gracePeriodSeconds": 0})
                        confirmed.add(meta["uid"])
                    except Exception:
                        pass


class Operator:
    """`python -m elastrain_operator` as a child process with short test intervals."""

    def __init__(self, kubeconfig: Path, namespace: str, log_dir: Path,
                 extra: tuple[str, ...] = ("--standalone",)) -> None:
        self.kubeconfig, self.ns, self.extra = kubeconfig, namespace, extra
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.starts += 1
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "ELASTRAIN_TIMER_INTERVAL_SECONDS": "1",
               "ELASTRAIN_PROGRESS_INTERVAL_SECONDS": "1",
               "ELASTRAIN_HANDLER_BACKOFF_SECONDS": "1"}
        log = open(self.log_dir / f"operator-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastrain_operator", "--namespace", self.ns, *self.extra],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace")
                       for p in sorted(self.log_dir.glob("operator-*.log")))


@pytest.fixture(scope="session")
def peering_crds(crd: Any) -> Any:
    kubectl(crd, "apply", "--server-side", "-f", str(PEERING_CRDS))
    wait_established(crd, "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev")
    # Discovery lags Established; an operator started before it would not see the peering kind.
    wait_for("kopf peering kinds in discovery",
             lambda: kubectl(crd, "get", "kopfpeerings", "-A", check=False).returncode == 0)
    return crd


@pytest.fixture
def cluster(crd: Any, kube_namespace: str) -> Iterator[Cluster]:
    api_client = crd.api_client()
    kube = Kube(api_client)
    kubelet = FakeKubelet(kube, kube_namespace)
    kubelet.thread.start()
    try:
        c = Cluster(kube, kube_namespace, crd)
        c.kubelet = kubelet
        yield c
    finally:
        kubelet.stop.set()
        kubelet.thread.join(5)
        api_client.close()


@pytest.fixture
def operator_factory(crd: Any, kube_namespace: str, tmp_path: Path,
                     request: pytest.FixtureRequest) -> Iterator[Callable[..., Operator]]:
    started: list[Operator] = []

    def make(*extra: str, name: str = "op") -> Operator:
        log_dir = tmp_path / name
        log_dir.mkdir()
        op = Operator(Path(crd.kubeconfig), kube_namespace, log_dir,
                      extra=extra or ("--standalone",))
        started.append(op)
        return op

    yield make
    for op in started:
        op.stop()
    report = getattr(request.node, "operator_call_report", None)
    if report is not None and report.failed:
        for op in started:
            sys.stderr.write(f"--- operator {op.log_dir.name} logs ---\n{op.logs()[-20000:]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep the call phase's report on the item, so a failed test prints the operator's logs."""
    report = yield
    if report.when == "call":
        item.operator_call_report = report  # type: ignore[attr-defined]
    return report


@pytest.fixture
def operator(operator_factory: Callable[..., Operator]) -> Operator:
    op = operator_factory()
    op.start()
    return op



