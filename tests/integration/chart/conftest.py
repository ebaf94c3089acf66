"""Fixtures of the chart's integration tests: a helm that talks to the test apiserver, the
monitoring.coreos.com stand-in CRDs, and releases that are uninstalled afterwards."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import kubectl, wait_established
from tests.unit.chart.chartlib import CHART, helm_or_skip

MONITORING_CRDS = Path(__file__).with_name("monitoring-crds.yaml")


def helm(kube: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(helm_or_skip()), "--kubeconfig", str(kube.kubeconfig), *args],
                          capture_output=True, text=True, timeout=180)
    if check and done.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done


def wait_for_kinds(kube: Any, *resources: str) -> None:
    """Discovery lags a CRD's Established condition; wait until kubectl resolves each resource."""
    deadline = time.monotonic() + 30
    for resource in resources:
        while kubectl(kube, "get", resource, "-A", check=False).returncode != 0:
            if time.monotonic() > deadline:
                pytest.fail(f"{resource} never appeared in discovery")
            time.sleep(0.3)


@pytest.fixture(scope="session")
def monitoring_crds(crd: Any) -> Any:
    """The TrainingJob CRD plus the ServiceMonitor/PodMonitor stand-ins, Established."""
    kubectl(crd, "apply", "--server-side", "--force-conflicts", "-f", str(MONITORING_CRDS))
    wait_established(crd, "servicemonitors.monitoring.coreos.com",
                     "podmonitors.monitoring.coreos.com")
    wait_for_kinds(crd, "servicemonitors.monitoring.coreos.com",
                   "podmonitors.monitoring.coreos.com")
    return crd


Installer = Callable[..., tuple[str, subprocess.CompletedProcess[str]]]


@pytest.fixture
def install_chart(monitoring_crds: Any) -> Iterator[Installer]:
    """helm install the chart (unique release names); every release is uninstalled afterwards."""
    releases: list[tuple[str, str]] = []

    def install(namespace: str, *extra: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        release = f"et-{uuid.uuid4().hex[:6]}"
        done = helm(monitoring_crds, "install", release, str(CHART), "--namespace", namespace,
                    *extra)
        releases.append((release, namespace))
        return release, done

    yield install
    for release, namespace in releases:
        helm(monitoring_crds, "uninstall", release, "--namespace", namespace, "--wait=false",
             check=False)
