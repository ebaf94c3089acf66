"""Every example object is accepted by the real apiserver (server-side dry-run create), with the
TrainingJob CRD's schema and CEL rules applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import kubectl
from tests.unit.chart.chartlib import EXAMPLES, load_docs

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("path", EXAMPLES, ids=[f"{p.parent.name}/{p.name}" for p in EXAMPLES])
def test_example_is_accepted_by_the_apiserver(crd: Any, kube_namespace: str, path: Path) -> None:
    docs = load_docs(path)
    namespaced = []
    for doc in docs:
        if doc["kind"] == "Namespace":
            continue  # the test namespace stands in for it
        doc["metadata"]["namespace"] = kube_namespace
        namespaced.append(doc)
    assert any(d["kind"] == "TrainingJob" for d in namespaced) or path.name == "minio.yaml"
    done = kubectl(crd, "create", "--dry-run=server", "--validate=strict", "-o", "name",
                   "-f", "-", input_text=yaml.safe_dump_all(namespaced), check=False)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == len(namespaced)


def test_apiserver_refuses_a_broken_example(crd: Any, kube_namespace: str) -> None:
    """The dry-run really applies the CRD's rules: an example with an impossible batch fails."""
    (job,) = [d for d in load_docs(EXAMPLES[0].parent.parent / "kind" / "cpu-gloo.yaml")
              if d["kind"] == "TrainingJob"]
    job["metadata"]["namespace"] = kube_namespace
    job["spec"]["trainer"]["globalBatchSize"] = 13
    done = kubectl(crd, "create", "--dry-run=server", "-f", "-",
                   input_text=yaml.safe_dump(job), check=False)
    assert done.returncode != 0 and "globalBatchSize" in done.stderr
