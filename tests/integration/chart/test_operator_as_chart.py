"""The real operator runs on the tests' apiserver as the chart's ServiceAccount (a token from the
TokenRequest API) with the command-line flags the chart's Deployment renders: it becomes live,
serves metrics, reconciles a TrainingJob into worker pods, and never hits a Forbidden. This is
the proof that the chart's least-privilege RBAC and flags are enough, not just a subset of RULES.
"""

from __future__ import annotations

import json
import os
import re
import socket
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

from tests.integration.chart.conftest import Installer, helm
from tests.integration.conftest import kubectl
from tests.unit.chart.chartlib import ROOT
from tests.unit.operator.builders import make_job_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SA = "elastrain"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def _rendered_container(kube: Any, release: str, namespace: str) -> dict[str, Any]:
    manifest = helm(kube, "get", "manifest", release, "--namespace", namespace).stdout
    (deployment,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment"]
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
    health, metrics = _free_port(), _free_port()
    args = _local_args(container["args"], health, metrics)
    assert ("--standalone" in args) == (mode == "cluster-wide-standalone")
    env = {**os.environ, "KUBECONFIG": str(_service_account_kubeconfig(
        monitoring_crds, kube_namespace, tmp_path / "kubeconfig")),
        "ELASTRAIN_TIMER_INTERVAL_SECONDS": "1", "ELASTRAIN_HANDLER_BACKOFF_SECONDS": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    for item in container["env"]:
        env[item["name"]] = item.get("value", "operator-under-test")  # POD_ID's fieldRef
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
