"""Nodes of a test's own for the operator tier (no kubelet backs them, as the tier's fake
node): each carries a taint only its test's job tolerates, so no other test's pod lands on a
node a test taints, cordons or marks NotReady."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from elastrain_operator.k8s.client import Kube

POOL = "elastrain.dev/test-pool"
ONLY = "elastrain.dev/test-only"


def make_node(kube: Kube, name: str, pool: str, *, cordoned: bool) -> None:
    kube.request("POST", "/api/v1/nodes", body={
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, POOL: pool,
                                              "kubernetes.io/os": "linux"}}})
    capacity = {"cpu": "64", "memory": "256Gi", "pods": "110"}
    kube.patch(f"/api/v1/nodes/{name}/status", {"status": {
        "capacity": capacity, "allocatable": capacity,
        "conditions": [ready_condition("True", "TestNode")]}})
    # Replaces the not-ready taint admission put on it: only the test's job may land here.
    kube.patch(f"/api/v1/nodes/{name}", {"spec": {
        "unschedulable": cordoned,
        "taints": [{"key": ONLY, "value": pool, "effect": "NoSchedule"}]}})


def ready_condition(status: str, reason: str) -> dict[str, str]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "Ready", "status": status, "reason": reason, "message": "no kubelet",
            "lastHeartbeatTime": now, "lastTransitionTime": now}


def pinned(pool: str) -> dict[str, Any]:
    """A job template's part that puts its pods on the pool's nodes only."""
    return {"nodeSelector": {POOL: pool}, "tolerations": [
        {"key": ONLY, "operator": "Equal", "value": pool, "effect": "NoSchedule"}]}


@contextmanager
def own_nodes(kube: Kube, prefix: str, *cordoned: bool) -> Iterator[tuple[str, list[str]]]:
    """(pool, node names): one node per flag, cordoned where it says so; deleted after."""
    pool = uuid.uuid4().hex[:8]
    names = [f"{prefix}-{chr(ord('a') + i)}-{pool}" for i in range(len(cordoned))]
    try:
        for name, flag in zip(names, cordoned, strict=True):
            make_node(kube, name, pool, cordoned=flag)
        yield pool, names
    finally:
        for name in names:
            kube.delete(f"/api/v1/nodes/{name}")
