"""The real operator runs on the tests' apiserver as the chart's ServiceAccount (a token from the
TokenRequest API) with the command-line flags the chart's Deployment renders: it becomes live,
serves metrics, reconciles a TrainingJob into worker pods, and never hits a Forbidden. This is
the proof that the chart's least-privilege RBAC and flags are enough, not just a subset of RULES.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastrain_trainer.ports import free_port
from tests.integration.chart.conftest import Installer, helm
from tests.integration.conftest import kubectl, scrape
from tests.unit.chart.chartlib import CHART, ROOT
from tests.unit.operator.builders import make_job_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SA = "elastrain"
RECONCILES = "elastrain_operator_reconcile_duration_seconds_count"  # every reconcile, any result
TICKERS = "elastrain_operator_tickers"  # per-job tickers running on this replica


def _eventually(what: str, probe: Callable[[], Any], timeout: float, logs: Callable[[], str]
                ) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout} s; operator log:\n{logs()[-4000:]}")
        time.sleep(0.5)


def _service_account_kubeconfig(kube: Any, namespace: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount with a bound token."""
    token = kubectl(kube, "create", "token", SA, "-n", namespace, "--duration=30m").stdout.strip()
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    cluster = admin["clusters"][0]
    config = {"apiVersion": "v1", "kind": "Config", "clusters": [cluster],
              "users": [{"name": "operator", "user": {"token": token}}],
              "contexts": [{"name": "operator", "context": {"cluster": cluster["name"],
                                                            "user": "operator"}}],
              "current-context": "operator"}
    path.write_text(yaml.safe_dump(config))
    return path


def _rendered_deployment(kube: Any, release: str, namespace: str) -> dict[str, Any]:
    manifest = helm(kube, "get", "manifest", release, "--namespace", namespace).stdout
    (deployment,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment"]
    return dict(deployment)


def _rendered_container(kube: Any, release: str, namespace: str) -> dict[str, Any]:
    deployment = _rendered_deployment(kube, release, namespace)
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _local_args(args: list[str], health: int, metrics: int) -> list[str]:
    """The chart's flags with the pod's ports moved to free loopback ports."""
    local = []
    for arg in args:
        if arg.startswith("--liveness="):
            arg = f"--liveness=http://127.0.0.1:{health}/healthz"
        elif arg.startswith("--metrics-port="):
            arg = f"--metrics-port={metrics}"
        local.append(arg)
    return local


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bytes(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@pytest.mark.parametrize("mode", ["cluster-wide-standalone", "namespaced-peering"])
def test_operator_works_with_exactly_the_charts_rbac_and_flags(
        install_chart: Installer, monitoring_crds: Any, kube_namespace: str, tmp_path: Path,
        mode: str) -> None:
    sets = ["--set", f"fullnameOverride={SA}"]
    if mode == "namespaced-peering":
        sets += ["--set", "peering.enabled=true",
                 "--set", f"operator.watchNamespaces.{kube_namespace}=true"]
    release, _ = install_chart(kube_namespace, *sets)
    container = _rendered_container(monitoring_crds, release, kube_namespace)
    health, metrics = free_port(), free_port()
    args = _local_args(container["args"], health, metrics)
    assert ("--standalone" in args) == (mode == "cluster-wide-standalone")
    env = {**os.environ, "KUBECONFIG": str(_service_account_kubeconfig(
        monitoring_crds, kube_namespace, tmp_path / "kubeconfig")),
        "ELASTRAIN_TIMER_INTERVAL_SECONDS": "1", "ELASTRAIN_HANDLER_BACKOFF_SECONDS": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env.update(_container_env(monitoring_crds, container, kube_namespace, "operator-under-test"))
    log_path = tmp_path / "operator.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "elastrain_operator", *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def logs() -> str:
        return log_path.read_text(errors="replace")

    try:
        _eventually("kopf's /healthz answers", lambda: _get(
            f"http://127.0.0.1:{health}/healthz"), 60, logs)
        kubectl(monitoring_crds, "apply", "-n", kube_namespace, "-f", "-",
                input_text=json.dumps(make_job_manifest("chart-identity")))
        pods = _eventually("worker pods created", lambda: json.loads(kubectl(
            monitoring_crds, "get", "pods", "-n", kube_namespace, "-o", "json", "-l",
            "elastrain.dev/job-name=chart-identity,elastrain.dev/role=worker").stdout)["items"],
            60, logs)
        assert pods
        # An in-process job (the built-in trainer's default): its control Secret, created
        # under the chart's identity with the token of the chart's key (control.py).
        from elastrain_operator.control import job_token
        secret = json.loads(kubectl(monitoring_crds, "get", "secret", "chart-identity-control",
                                    "-n", kube_namespace, "-o", "json").stdout)
        uid = pods[0]["metadata"]["ownerReferences"][0]["uid"]
        assert base64.b64decode(secret["data"]["token"]).decode() == job_token(
            env["ELASTRAIN_CONTROL_KEY"].encode(), uid)
        _eventually("status.phase written", lambda: json.loads(kubectl(
            monitoring_crds, "get", "tj", "chart-identity", "-n", kube_namespace, "-o",
            "json").stdout).get("status", {}).get("phase"), 30, logs)
        text = _eventually("metrics served", lambda: _get(
            f"http://127.0.0.1:{metrics}/metrics"), 10, logs)
        assert b"elastrain_operator_reconcile_total" in text
        if mode == "namespaced-peering":
            _eventually("the operator created its KopfPeering", lambda: kubectl(
                monitoring_crds, "get", "kopfpeering", SA, "-n", kube_namespace,
                check=False).returncode == 0, 30, logs)
        assert proc.poll() is None, logs()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    # RBAC denials name the user ("... is forbidden: User \"system:serviceaccount:..\" cannot
    # list resource ..."); other 403s (a namespace being deleted by another test) are not ours.
    denials = re.findall(r'forbidden: User "[^"]+" cannot [^\n]*', logs())
    assert not denials, "\n".join(denials[:10])
    # kopf swallows its own 403s (namespaces, CRDs) into a fallback and this warning.
    lacking = re.findall(r"Not enough permissions[^\n]*", logs())
    assert not lacking, "\n".join(lacking)


def _container_env(kube: Any, container: dict[str, Any], namespace: str,
                   pod: str) -> dict[str, str]:
    """The container's environment as the kubelet gives it: POD_ID's fieldRef is the pod's
    name, a secretKeyRef (the control key) is read from the Secret the chart installed."""
    env: dict[str, str] = {}
    for item in container["env"]:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            secret = json.loads(kubectl(kube, "get", "secret", ref["name"], "-n", namespace,
                                        "-o", "json").stdout)
            env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        else:
            env[item["name"]] = item.get("value", pod)
    return env


def _start_replica(kube: Any, namespace: str, container: dict[str, Any], kubeconfig: Path,
                   pod: str, log_path: Path, health: int,
                   metrics: int) -> subprocess.Popen[bytes]:
    """One operator replica as the chart's Deployment starts it; POD_ID is its pod's name."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "ELASTRAIN_TIMER_INTERVAL_SECONDS": "1",
           "ELASTRAIN_HANDLER_BACKOFF_SECONDS": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env.update(_container_env(kube, container, namespace, pod))
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "elastrain_operator",
             *_local_args(container["args"], health, metrics)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _sample(port: int, name: str, logs: Callable[[], str]) -> float:
    samples = _eventually(f"/metrics on port {port}", lambda: scrape(port), 10, logs)
    return float(samples[name])


def _reconciles(port: int, logs: Callable[[], str]) -> float:
    return _sample(port, RECONCILES, logs)


def _steady_reconciles(port: int, logs: Callable[[], str], quiet: float = 3.0) -> float:
    """A paused replica's reconcile count, once it has not moved for `quiet` seconds (three
    timer rounds); fails if it keeps moving."""
    deadline = time.monotonic() + 60
    last, since = _reconciles(port, logs), time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            pytest.fail(f"the replica on {port} never stopped reconciling:\n{logs()[-4000:]}")
        time.sleep(0.5)
        if (now := _reconciles(port, logs)) != last:
            last, since = now, time.monotonic()
    return last


def test_charts_ha_values_run_two_replicas_of_which_one_acts(
        install_chart: Installer, monitoring_crds: Any, kube_namespace: str,
        tmp_path: Path) -> None:
    """charts/elastrain/ci/ha-values.yaml as shipped (2 replicas, cluster-wide peering, no
    --priority so each replica draws a random one): two operators with exactly the rendered
    flags and ServiceAccount, started together like the Deployment's two pods, elect one. Once
    each has seen the other in the ClusterKopfPeering, only the one with the higher priority
    reconciles, as each replica's own reconcile counter shows.

    Started at the same moment, the lower one may act for a moment first: kopf resumes a replica
    on the first peering event that lists no one above it, and the events queued meanwhile are
    still handled after it pauses. The counts of that overlap are printed."""
    release, _ = install_chart(kube_namespace, "--values", str(CHART / "ci" / "ha-values.yaml"),
                               "--set", f"fullnameOverride={SA}")
    deployment = _rendered_deployment(monitoring_crds, release, kube_namespace)
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    peering = "elastrain-ha"
    assert f"--peering={peering}" in container["args"] and "--all-namespaces" in container["args"]
    assert not [a for a in container["args"] if a.startswith(("--priority", "--standalone"))]
    kubeconfig = _service_account_kubeconfig(monitoring_crds, kube_namespace,
                                             tmp_path / "kubeconfig")
    pods = [f"{SA}-replica-{i}" for i in range(2)]
    ports = {pod: (free_port(), free_port()) for pod in pods}
    procs = {pod: _start_replica(monitoring_crds, kube_namespace, container, kubeconfig, pod,
                                 tmp_path / f"{pod}.log", *ports[pod])
             for pod in pods}

    def logs() -> str:
        return "".join(f"--- {pod} ---\n" + (tmp_path / f"{pod}.log").read_text(errors="replace")
                       for pod in pods)

    def peers() -> dict[str, int] | None:
        done = kubectl(monitoring_crds, "get", "clusterkopfpeering", peering, "-o", "json",
                       check=False)
        status = json.loads(done.stdout).get("status") or {} if done.returncode == 0 else {}
        found = {peer: int(entry["priority"]) for peer, entry in status.items()}
        return found if set(found) == set(pods) else None

    try:
        for pod in pods:
            _eventually(f"{pod}'s /healthz answers", functools.partial(
                _get, f"http://127.0.0.1:{ports[pod][0]}/healthz"), 60, logs)
        priorities = _eventually("both replicas in the ClusterKopfPeering", peers, 60, logs)
        assert len(set(priorities.values())) == 2, priorities  # drawn at random: no tie
        active = max(priorities, key=lambda pod: priorities[pod])
        (paused,) = set(pods) - {active}
        before = {paused: _steady_reconciles(ports[paused][1], logs)}
        before[active] = _reconciles(ports[active][1], logs)  # its timers never stop
        print(f"reconciles before the replicas settled: {before} (priorities {priorities})")
        kubectl(monitoring_crds, "apply", "-n", kube_namespace, "-f", "-",
                input_text=json.dumps(make_job_manifest("ha")))
        def workers() -> int:
            return len(json.loads(kubectl(
                monitoring_crds, "get", "pods", "-n", kube_namespace, "-o", "json", "-l",
                "elastrain.dev/job-name=ha,elastrain.dev/role=worker").stdout)["items"])

        _eventually("worker pods created", lambda: workers() == 2, 60, logs)
        # What a replica that acts does, seen on the active one, before the paused one is
        # judged by not doing it: its ticker for the job runs, and it answered a later change
        # too (a scale-up made after the first workers existed), so the paused replica, which
        # saw the job's creation as early, would have reconciled it and started its ticker.
        kubectl(monitoring_crds, "scale", "-n", kube_namespace, "tj/ha", "--replicas=3")
        _eventually("the third worker created", lambda: workers() == 3, 60, logs)
        _eventually("the active replica's ticker for the job",
                    lambda: _sample(ports[active][1], TICKERS, logs) >= 1, 30, logs)
        after = {pod: _reconciles(ports[pod][1], logs) for pod in pods}
        assert after[active] > before[active], (priorities, before, after)
        assert after[paused] == before[paused], (priorities, before, after, logs()[-8000:])
        assert _sample(ports[paused][1], TICKERS, logs) == 0, logs()[-8000:]
        assert all(proc.poll() is None for proc in procs.values()), logs()
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    text = logs()
    assert not re.findall(r'forbidden: User "[^"]+" cannot [^\n]*', text), text[-4000:]
    assert "Traceback (most recent call last)" not in text, text[-8000:]
