"""Exactly what the operator does to the API, as RBAC rules the Helm chart mirrors.

A unit test checks the chart grants these and nothing else. No Secrets, no Nodes: problems with
Secrets are read from the pods' waiting reasons, and node loss arrives as a pod condition.
"""

from __future__ import annotations

from typing import Final, NamedTuple


class Rule(NamedTuple):
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]


RULES: Final[tuple[Rule, ...]] = (
    # The jobs: watched by kopf, read fresh by every reconcile, deleted by the TTL, and patched
    # by kopf for its finalizer.
    Rule(("elastrain.dev",), ("trainingjobs",),
         ("get", "list", "watch", "patch", "delete")),
    Rule(("elastrain.dev",), ("trainingjobs/status",), ("get", "update", "patch")),
    # Workers and rendezvous stores (watched into the operator's view); patch removes the
    # accounting finalizer.
    Rule(("",), ("pods",), ("get", "list", "watch", "create", "delete", "patch")),
    Rule(("",), ("services",), ("get", "list", "watch", "create")),
    Rule(("",), ("events",), ("create", "patch")),  # ours and kopf's (core v1 events)
    # kopf peering: which replica acts; the operator creates its peering object when missing.
    Rule(("kopf.dev",), ("kopfpeerings", "clusterkopfpeerings"),
         ("get", "list", "watch", "patch", "create")),
    # kopf discovers the resources it serves and watches namespaces in cluster-wide mode.
    Rule(("apiextensions.k8s.io",), ("customresourcedefinitions",), ("get", "list", "watch")),
    Rule(("",), ("namespaces",), ("get", "list", "watch")),
)
