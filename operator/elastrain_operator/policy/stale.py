"""How the operator removes a worker pod that is no longer its slot's (a stale attempt: a loss
counted, a planned-out pod replaced, a move done), issue 34 item 4.

A graceful delete first: the trainer gets its SIGTERM and the kubelet confirms the end, so no
process outlives its object (Kubernetes' own advice: force-delete a pod only when its node is
known to be gone; a force-deleted pod on a live node keeps running with nothing to show it).
A force-delete (grace 0) where no kubelet will confirm:
- the pod's node is lost: its Ready condition is False or Unknown, or it carries the node
  controller's NoExecute not-ready/unreachable taint (what the Node says, k8s.nodes keeps it);
  a graceful delete would leave the pod Terminating until the node answers, which it may never;
- the pod is still there OVERDUE_SECONDS after its grace period ended: the operator cannot read
  nodes (notices off), or the node is not marked yet (the node controller waits 40 s).
A stale in-process pod whose process still runs is fenced either way (docs/recovery.md
section 9): forcing only shortens how long its object is seen.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from elastrain_operator.policy.failures import WorkerPod, aware_time
from elastrain_operator.render.node_loss import NODE_LOSS_TAINTS

# After the grace period a kubelet kills what is left at once and confirms within seconds.
OVERDUE_SECONDS = 30.0


class Removal(StrEnum):
    DELETE = "delete"
    FORCE = "force"


def node_lost(node: Mapping[str, Any]) -> str | None:
    """Why a Node will not confirm its pods' end, or None while it may: the node controller's
    NoExecute taint, else its Ready condition not True. A node that reports no Ready condition
    yet (just registered) is not lost."""
    for taint in (node.get("spec") or {}).get("taints") or ():
        if taint.get("key") in NODE_LOSS_TAINTS and taint.get("effect") == "NoExecute":
            return f"taint {taint['key']}"
    ready = next((cond for cond in (node.get("status") or {}).get("conditions") or ()
                  if cond.get("type") == "Ready"), None)
    if ready is None or ready.get("status") == "True":
        return None
    reason = ready.get("reason")
    return f"Ready={ready.get('status')}" + (f" ({reason})" if reason else "")


def node_lost_since(node: Mapping[str, Any]) -> datetime | None:
    """When a lost node's loss began, as the Node says: its node-loss NoExecute taint's
    timeAdded, else its Ready condition's lastTransitionTime; None when it does not say."""
    for taint in (node.get("spec") or {}).get("taints") or ():
        if taint.get("key") in NODE_LOSS_TAINTS and taint.get("effect") == "NoExecute":
            return aware_time(taint.get("timeAdded"))
    ready = next((cond for cond in (node.get("status") or {}).get("conditions") or ()
                  if cond.get("type") == "Ready"), None)
    return aware_time(ready.get("lastTransitionTime")) if ready is not None else None


def lost_under(created: datetime | None, node: str, lost_nodes: Mapping[str, str],
               lost_since: Mapping[str, datetime]) -> str | None:
    """Why `node` is lost for a pod of it created at `created`, or None. A pod created after
    the node's loss began never ran there before it: it was placed on it in the moment the
    node's marks and the scheduler's view of them disagree (a node marked NotReady while it
    comes back, its kubelet late to renew after a partition lifts: the node controller's
    NoSchedule and NoExecute taints are set and cleared apart). Doomed as on a lost node, each
    such pod would be counted a failure and replaced at once, onto the same node, until
    maxRestarts ran out (seen on the two nodes: four in two seconds, the job Failed); it is
    left to start, or to the taint manager's eviction once its toleration runs out if the
    node stays lost."""
    why = lost_nodes.get(node) if node else None
    began = lost_since.get(node) if why is not None else None
    if why is None or (began is not None and created is not None and created > began):
        return None
    return why


def removal(pod: WorkerPod, lost_nodes: Mapping[str, str], now: datetime) -> Removal | None:
    """How to remove a stale pod this round, or None: its graceful delete is under way."""
    if pod.node and pod.node in lost_nodes:
        return Removal.FORCE
    if not pod.deleting:
        return Removal.DELETE
    ends = pod.deletion_deadline
    if ends is not None and now >= ends + timedelta(seconds=OVERDUE_SECONDS):
        return Removal.FORCE
    return None
