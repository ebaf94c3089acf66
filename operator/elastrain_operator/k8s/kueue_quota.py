"""Quota as Kueue states it, read into what policy.kueue_yield decides on: a waiting Workload's
shortfall (its QuotaReserved message) and what one pod of the job asks for. Quantities are
parsed here with the Kubernetes client's parser, which the policy layer may not import."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import (  # type: ignore[import-untyped]
    parse_quantity as _parse_quantity,
)

from elastrain_operator.policy.kueue_yield import QueueTerms, Waiting

Manifest = dict[str, Any]

# Kueue's QuotaReserved message for a Workload that does not fit (its flavor assigner): one
# clause per resource short, e.g. "insufficient unused quota for cpu in flavor F, 300m more
# needed" (seen from v0.17.0: tests/integration/kueue/test_kueue_yield.py).
_SHORT = re.compile(r"insufficient unused quota for (?P<resource>[\w./-]+) in flavor "
                    r"(?P<flavor>[\w.-]+), (?P<amount>[0-9.]+[A-Za-z]*) more needed")


def quantity(text: object) -> Decimal:
    """A Kubernetes quantity ("300m", "1Gi") as a number."""
    return Decimal(_parse_quantity(text))  # type: ignore[no-untyped-call]


def shortfall(message: str) -> dict[str, tuple[str, Decimal]]:
    """resource -> (flavor, amount short), from a QuotaReserved message."""
    return {m["resource"]: (m["flavor"], quantity(m["amount"]))
            for m in _SHORT.finditer(message)}


def waiting_of(workload: Manifest) -> Waiting | None:
    """A Workload Kueue tried and could not fit, as a Waiting; None for any other (admitted,
    not tried yet, deactivated, being deleted)."""
    status = workload.get("status") or {}
    if status.get("admission"):
        return None
    reserved = next((c for c in status.get("conditions") or []
                     if c.get("type") == "QuotaReserved"), None)
    if reserved is None or reserved.get("status") != "False":
        return None
    meta = workload.get("metadata") or {}
    if meta.get("deletionTimestamp") or (workload.get("spec") or {}).get("active") is False:
        return None
    return Waiting(namespace=str(meta.get("namespace", "")), name=str(meta.get("name", "")),
                   priority=int((workload.get("spec") or {}).get("priority") or 0),
                   short=shortfall(str(reserved.get("message") or "")))


def pod_requests(template: Manifest) -> dict[str, Decimal]:
    """What one pod asks for, as Kueue counts it: its containers' requests summed (a limit
    stands for a missing request), an init container's where larger, plus the overhead."""
    spec = template.get("spec") or {}

    def of(container: Manifest) -> dict[str, Decimal]:
        res = container.get("resources") or {}
        table = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {k: quantity(v) for k, v in table.items()}

    total: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        for key, value in of(container).items():
            total[key] = total.get(key, Decimal(0)) + value
    for container in spec.get("initContainers") or []:
        for key, value in of(container).items():
            total[key] = max(total.get(key, Decimal(0)), value)
    for key, value in (spec.get("overhead") or {}).items():
        total[key] = total.get(key, Decimal(0)) + quantity(value)
    return total


def queue_terms(cluster_queue: Manifest) -> QueueTerms:
    """A ClusterQueue's cohort, reclaim policy and lending and borrowing limits."""
    spec = cluster_queue.get("spec") or {}
    limits: dict[str, dict[tuple[str, str], Decimal]] = {"lendingLimit": {},
                                                          "borrowingLimit": {}}
    for group in spec.get("resourceGroups") or []:
        for flavor in group.get("flavors") or []:
            for resource in flavor.get("resources") or []:
                for kind, table in limits.items():
                    if resource.get(kind) is not None:
                        table[(str(flavor.get("name")), str(resource.get("name")))] = \
                            quantity(resource[kind])
    return QueueTerms(cohort=spec.get("cohortName") or None,
                      reclaim_within_cohort=(spec.get("preemption") or {}).get(
                          "reclaimWithinCohort"),
                      lending=limits["lendingLimit"], borrowing=limits["borrowingLimit"])
