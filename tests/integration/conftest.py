"""Integration fixtures shared by operator tests: the TrainingJob CRD on the real apiserver."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.ports import free_port as free_port
from tests.integration.kueue.fixtures import (  # noqa: F401 (fixtures, started on demand)
    kueue,
    kueue_namespace,
    kueue_queues,
)

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "trainingjobs.elastrain.dev.yaml"


def kubectl(kube: Any, *args: str, input_text: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run kubectl against the test cluster."""
    return subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), *args],
                          input=input_text, capture_output=True, text=True, check=check,
                          timeout=120)


def scrape(port: int) -> dict[str, float] | None:
    """The samples a process serves on 127.0.0.1:<port>/metrics ("name{labels}" -> value);
    None when nothing answers, so a process that is silent is never read as counting zero."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def wait_established(kube: Any, *names: str, timeout: float = 180) -> None:
    """Poll each CRD's Established condition. One `kubectl wait` right after the apply failed
    under load ("no matching resources", exit 1, well before its timeout): the CRD was not
    readable yet."""
    path = 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
    deadline = time.monotonic() + timeout
    for name in names:
        while (done := kubectl(kube, "get", f"crd/{name}", "-o", path, check=False)
               ).stdout.strip() != "True":
            if time.monotonic() > deadline:
                pytest.fail(f"CRD {name} not Established in {timeout} s: {done.stderr.strip()}")
            time.sleep(0.5)


@pytest.fixture(scope="session")
def crd(kube: Any) -> Iterator[Any]:
    """The TrainingJob CRD applied and Established on the test apiserver."""
    kubectl(kube, "apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    wait_established(kube, "trainingjobs.elastrain.dev")
    # Discovery lags Established by a moment; wait until `kubectl get tj` resolves the kind.
    deadline = time.monotonic() + 30
    while kubectl(kube, "get", "tj", "-A", check=False).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail("TrainingJob kind never appeared in discovery")
        time.sleep(0.5)
    yield kube
