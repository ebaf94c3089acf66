"""A Kueue Workload's status conditions as the operator reads and writes them (policy.kueue for
the job's Workload, policy.kueue_grow for its extra one): reading, setting as metav1 does, and
the status that gives an evicted Workload's quota back."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

Manifest = dict[str, Any]
# Kueue's eviction reasons after which its own integrations requeue (jobframework step 6).
REQUEUED_AFTER = ("Preempted", "AdmissionCheck")


def conditions_of(workload: Manifest) -> dict[str, Manifest]:
    return {str(x.get("type")): x for x in (workload.get("status") or {}).get("conditions") or []}


def is_true(conds: Mapping[str, Manifest], kind: str) -> bool:
    return (conds.get(kind) or {}).get("status") == "True"


def condition(kind: str, status: bool, reason: str, message: str, *, now: datetime,
              generation: int) -> Manifest:
    return {"type": kind, "status": "True" if status else "False", "reason": reason,
            "message": message[:32768], "lastTransitionTime": now.isoformat(),
            "observedGeneration": generation}


def with_condition(conds: list[Manifest], new: Manifest) -> list[Manifest]:
    """Set a condition as metav1 does: its transition time kept while its status stays."""
    out, found = [], False
    for cond in conds:
        if cond.get("type") != new["type"]:
            out.append(cond)
            continue
        found = True
        same = cond.get("status") == new["status"]
        out.append({**new, "lastTransitionTime": cond.get("lastTransitionTime")} if same
                   else new)
    return out if found else [*out, new]


def eviction(conds: Mapping[str, Manifest]) -> str:
    """Kueue's reason for an eviction, and by whom when it preempted."""
    evicted = conds.get("Evicted") or {}
    why = str(evicted.get("reason") or "Evicted")
    if is_true(conds, "Preempted"):
        why += f", {conds['Preempted'].get('reason')}"
    message = str(evicted.get("message") or "")
    return f"{why}: {message}" if message else why


def evicted_and_reserved(workload: Manifest | None) -> bool:
    conds = conditions_of(workload or {})
    return is_true(conds, "Evicted") and is_true(conds, "QuotaReserved")


def released_status(workload: Manifest, *, now: datetime) -> tuple[Manifest, bool]:
    """The status that gives an evicted Workload's quota back as Kueue's jobframework does once
    the job's pods are gone (admission cleared, QuotaReserved and Admitted False, Requeued
    after a preemption or an admission check), and whether it is requeued."""
    conds = conditions_of(workload)
    gen = int((workload.get("metadata") or {}).get("generation") or 0)
    evicted = conds.get("Evicted") or {}
    reason = str(evicted.get("reason") or "Evicted")
    message = str(evicted.get("message") or "")
    requeue = reason in REQUEUED_AFTER
    listed = list(conds.values())
    for new in (condition("QuotaReserved", False, "Pending", message, now=now, generation=gen),
                condition("Admitted", False, "NoReservation", "The workload has no reservation",
                          now=now, generation=gen),
                condition("Requeued", requeue, reason, message, now=now, generation=gen)):
        listed = with_condition(listed, new)
    # The next admission counts every pod set anew.
    return {"conditions": listed, "admission": None, "reclaimablePods": None}, requeue
