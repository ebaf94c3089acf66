"""A real Prometheus scrapes the operator's and a trainer's metrics (the real metrics modules,
served on loopback) and every query of the Grafana dashboard returns data; promtool finds
nothing to complain about in either exporter's output."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from elastrain_trainer.ports import free_port
from tests.unit.chart.chartlib import CHART, ROOT

pytestmark = pytest.mark.prometheus

EXPORTERS = Path(__file__).with_name("exporters.py")
DASHBOARD = json.loads((CHART / "files" / "dashboards" / "elastrain.json").read_text())
# Grafana's variables as the test resolves them: a 1 s scrape makes 10 s windows hold 10 samples.
NAMESPACE = "elastrain-demo"
VARIABLES = {"$__rate_interval": "10s", "$namespace": NAMESPACE}
# The PodMonitor's jobLabel makes `job` the TrainingJob's name; the static config mimics that.
TRAINING_JOB = "cpu-gloo"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{name} is missing and cannot be installed (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"apt-get install prometheus failed: {done.stderr[-500:]}")
    path = shutil.which(name)
    assert path, f"the Debian package prometheus did not install {name}"
    return path


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def _fetch(url: str) -> bytes | None:
    try:
        return _get(url)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _wait(url: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            _get(url)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                pytest.fail(f"{url} never answered")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def exporters() -> Iterator[dict[str, str]]:
    """The operator's and a trainer's /metrics on loopback: role -> URL."""
    procs, urls = [], {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "operator"), str(ROOT / "trainer_image"), os.environ.get("PYTHONPATH", "")])}
    try:
        for role in ("operator", "trainer"):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, str(EXPORTERS), role, str(port)],
                                          env=env, stderr=subprocess.PIPE, text=True))
            urls[role] = f"http://127.0.0.1:{port}/metrics"
        for proc, url in zip(procs, urls.values(), strict=True):
            deadline = time.monotonic() + 30
            while _fetch(url) is None:
                if proc.poll() is not None:
                    pytest.fail(f"exporter {proc.args} exited:\n{proc.communicate()[1]}")
                if time.monotonic() > deadline:
                    pytest.fail(f"{url} never answered")
                time.sleep(0.2)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def prometheus(exporters: dict[str, str], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[str]:
    """A real Prometheus on loopback scraping both exporters every second; yields its URL."""
    binary = _tool("prometheus")
    directory = tmp_path_factory.mktemp("prometheus")
    target = {role: urllib.parse.urlparse(url).netloc for role, url in exporters.items()}
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "elastrain-operator",
             "static_configs": [{"targets": [target["operator"]]}]},
            {"job_name": TRAINING_JOB,
             "static_configs": [{"targets": [target["trainer"]],
                                 "labels": {"namespace": NAMESPACE}}]},
        ],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (directory / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={directory / 'prometheus.yml'}",
                             f"--storage.tsdb.path={directory / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(f"{url}/-/ready", seconds=60)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def _query(url: str, expr: str) -> list[dict[str, object]]:
    body = json.loads(_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert body["status"] == "success", body
    result: list[dict[str, object]] = body["data"]["result"]
    return result


def _has_data(result: list[dict[str, object]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)  # type: ignore[index]


def _dashboard_queries() -> list[tuple[str, str]]:
    queries = []
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"unresolved variable in {expr}"
            queries.append((f"{panel['title']} [{target['refId']}]", expr))
    return queries


def test_every_dashboard_query_returns_data(prometheus: str) -> None:
    queries = _dashboard_queries()
    assert len(queries) >= 10
    deadline = time.monotonic() + 45
    while True:
        empty = [(title, expr) for title, expr in queries
                 if not _has_data(_query(prometheus, expr))]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, "dashboard queries without data:\n" + "\n".join(
        f"  {title}: {expr}" for title, expr in empty)


def test_both_exporters_are_scraped_healthy(prometheus: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        targets = json.loads(_get(f"{prometheus}/api/v1/targets"))["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        if set(health.values()) == {"up"} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert health == {"elastrain-operator": "up", TRAINING_JOB: "up"}


def test_namespace_variable_really_filters(prometheus: str) -> None:
    """A query for another namespace is empty, so the data above is not there by accident."""
    expr = 'elastrain_trainer_loss{namespace=~"other-namespace"}'
    assert _query(prometheus, f"elastrain_trainer_loss{{namespace=~\"{NAMESPACE}\"}}")
    assert _query(prometheus, expr) == []


@pytest.mark.parametrize("role", ["operator", "trainer"])
def test_promtool_check_metrics_is_clean(exporters: dict[str, str], role: str) -> None:
    promtool = _tool("promtool")
    text = _get(exporters[role]).decode()
    assert f"elastrain_{role}_" in text
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (
        done.stdout + done.stderr)
