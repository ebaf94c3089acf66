"""The Kueue tests' operator: the operator tier's Cluster helper and fake kubelet over the Kueue
namespace, and the operator as a process, started after Kueue's API is served (it probes for it
at startup); its log is printed when a test fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.kueue.fixtures import KueueQueues
from tests.integration.operator.conftest import Cluster, FakeKubelet, Operator


@pytest.fixture
def kcluster(kueue_queues: KueueQueues, crd: Any) -> Iterator[Cluster]:
    """The operator tier's Cluster helper over the Kueue namespace, with its fake kubelet."""
    kubelet = FakeKubelet(kueue_queues.kube, kueue_queues.namespace)
    kubelet.thread.start()
    try:
        cluster = Cluster(kueue_queues.kube, kueue_queues.namespace, crd)
        cluster.kubelet = kubelet
        yield cluster
    finally:
        kubelet.stop.set()
        kubelet.thread.join(5)


@pytest.fixture
def kueue_operator(kcluster: Cluster, crd: Any, tmp_path: Path,
                   request: pytest.FixtureRequest) -> Iterator[Operator]:
    """The operator, started after Kueue's API is served (it probes for it at startup)."""
    op = Operator(Path(crd.kubeconfig), kcluster.ns, tmp_path)
    op.start()
    try:
        yield op
    finally:
        op.stop()
        report = getattr(request.node, "kueue_call_report", None)
        if report is not None and report.failed:
            print(f"--- operator logs ---\n{op.logs()[-20000:]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.kueue_call_report = report  # type: ignore[attr-defined]
    return report
