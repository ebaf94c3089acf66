"""What the nodes say about their going (policy.notices) and whether they are gone already
(policy.stale: NotReady or unreachable), as a watch of Nodes keeps it.

Nodes are cluster-scoped: reading them needs a ClusterRole even for an operator that serves
one namespace (the chart's `notices.enabled` grants get/list/watch on nodes). Without it the
operator turns notices off at startup and every in-process job's status says so
(`NodeDisruptionNotice` False, reason NoticesOff), rather than a watch that fails forever.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Any

from elastrain_operator.k8s.client import Kube, KubeError
from elastrain_operator.policy.notices import DEFAULT_NOTICE_TAINTS, node_notice
from elastrain_operator.policy.stale import node_lost, node_lost_since


class NodeNotices:
    """Thread-safe: the watch writes, reconcile rounds read. Only nodes with a notice or lost
    are kept: a cluster of thousands of quiet nodes costs nothing."""

    def __init__(self, taints: Collection[str]) -> None:
        self.taints = tuple(taints)
        self._lock = threading.Lock()
        self._said: dict[str, str] = {}
        self._lost: dict[str, str] = {}
        self._since: dict[str, datetime] = {}  # when each lost node's loss began, if it says

    def put(self, node: Mapping[str, Any]) -> bool:
        """A node's watch event; whether what it says changed."""
        name = str((node.get("metadata") or {}).get("name") or "")
        if not name:
            return False
        with self._lock:
            said = _set(self._said, name, node_notice(node, self.taints))
            lost = node_lost(node)
            since = node_lost_since(node) if lost is not None else None
            if since is None:
                self._since.pop(name, None)
            else:
                self._since[name] = since
            return _set(self._lost, name, lost) or said

    def remove(self, name: str) -> bool:
        with self._lock:
            said = _set(self._said, name, None)
            self._since.pop(name, None)
            return _set(self._lost, name, None) or said

    def of(self, nodes: Iterable[str]) -> dict[str, str]:
        """The notices among `nodes` (a job's workers' nodes)."""
        with self._lock:
            return {n: self._said[n] for n in nodes if n in self._said}

    def lost_of(self, nodes: Iterable[str]) -> dict[str, str]:
        """The lost nodes among `nodes`, with why."""
        with self._lock:
            return {n: self._lost[n] for n in nodes if n in self._lost}

    def lost_since_of(self, nodes: Iterable[str]) -> dict[str, datetime]:
        """When the loss of each lost node among `nodes` began (policy.stale.lost_under)."""
        with self._lock:
            return {n: self._since[n] for n in nodes if n in self._since}


def _set(known: dict[str, str], name: str, value: str | None) -> bool:
    if known.get(name) == value:
        return False
    if value is None:
        known.pop(name, None)
    else:
        known[name] = value
    return True


# The chart sets them (values `notices.*`).
ENABLED_VAR = "ELASTRAIN_NODE_NOTICES"  # "true" (default) or "false"
TAINTS_VAR = "ELASTRAIN_NOTICE_TAINTS"  # comma-separated taint keys; unset: the default list


def read_notice_settings(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The taint keys read as notices, or None when notices are off. ValueError names the
    variable that is wrong."""
    enabled = env.get(ENABLED_VAR, "true").strip().lower()
    if enabled not in ("true", "false"):
        raise ValueError(f"{ENABLED_VAR}={env[ENABLED_VAR]!r}: expected true or false")
    if enabled == "false":
        return None
    raw = env.get(TAINTS_VAR)
    if raw is None:
        return DEFAULT_NOTICE_TAINTS
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    bad = [k for k in keys if not _taint_key(k)]
    if bad:
        raise ValueError(f"{TAINTS_VAR}: {bad} are not taint keys ([prefix/]name)")
    return keys


def _taint_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    ok = all(c.isalnum() or c in "-_." for c in name) and 0 < len(name) <= 63
    return ok and all(c.isalnum() or c in "-." for c in prefix) and len(prefix) <= 253


def nodes_readable(kube: Kube) -> str | None:
    """None when the operator may list Nodes, else why not (its RBAC grants no ClusterRole)."""
    try:
        kube.request("GET", "/api/v1/nodes", query={"limit": "1"})
    except KubeError as err:
        if err.status in (401, 403):
            return (f"the operator may not list nodes ({err.status}): grant it the chart's "
                    "notices ClusterRole (notices.enabled) to act on node notices")
        raise
    return None
