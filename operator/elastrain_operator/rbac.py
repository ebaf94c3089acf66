"""Exactly what the operator does to the API, as RBAC rules the Helm chart mirrors.

A unit test checks the chart grants these and nothing else, in each mode. Secrets: create only
(each in-process job's control Secret, control.py), never read: problems with the user's Secrets
are read from the pods' waiting reasons. Nodes: read only (list and watch), and only for node
notices (k8s.nodes, the chart's `notices.enabled`); node loss arrives as a pod condition.

Each rule says where it is granted and when it is needed at all:
- `cluster_scoped=False`: rights over objects inside a namespace. A namespaced operator
  (`--namespace`, the chart's `operator.watchNamespaces`) gets them only in its namespaces, as a
  Role + RoleBinding in each; only a cluster-wide operator gets them from a ClusterRole.
- `cluster_scoped=True`: objects that live outside namespaces; always a ClusterRole.
- `mode`: kopf needs some rules in one mode only (read in kopf 1.45's
  `_core/reactor/observation.py` and `_core/engines/peering.py`): it lists and watches namespaces
  only when it serves named namespaces (to follow their creation and globs), never cluster-wide;
  it keeps its keep-alives in a ClusterKopfPeering cluster-wide and in a KopfPeering per
  namespace otherwise.
- `peering`: only with kopf peering; `--standalone` touches no peering object.
- `notices`: only when the operator reads node notices (policy.notices).
- `kueue`: only when the operator takes part in Kueue's admission (policy.kueue, the chart's
  `kueue.enabled`): each queued job's Workload (created, its status written on eviction and
  readiness, its finalizer removed), the LocalQueues (which namespaces have a `default`), and
  cluster-wide the ResourceFlavors an admission names, the priority classes a Workload is
  ordered by and the ClusterQueues' preemption policies (read only).
"""

from __future__ import annotations

from typing import Final, Literal, NamedTuple

Mode = Literal["cluster-wide", "namespaced"]


class Rule(NamedTuple):
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    cluster_scoped: bool = False
    mode: Mode | None = None  # None: needed in both modes
    peering: bool = False  # needed only with kopf peering
    notices: bool = False  # needed only when node notices are read
    kueue: bool = False  # needed only when Kueue's admission is followed


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
    # The per-job NetworkPolicy around the store and the workers (render/network.py).
    Rule(("networking.k8s.io",), ("networkpolicies",),
         ("get", "list", "watch", "create", "patch", "delete")),
    Rule(("",), ("events",), ("create", "patch")),  # ours and kopf's (core v1 events)
    # Each in-process job's control Secret (control.py): created, never read or changed.
    Rule(("",), ("secrets",), ("create",)),
    # kopf peering: which replica acts; the operator creates its peering object when missing.
    Rule(("kopf.dev",), ("kopfpeerings",), ("get", "list", "watch", "patch", "create"),
         mode="namespaced", peering=True),
    Rule(("kopf.dev",), ("clusterkopfpeerings",), ("get", "list", "watch", "patch", "create"),
         cluster_scoped=True, mode="cluster-wide", peering=True),
    # kopf watches CRDs to notice the resources it serves (re)appear; the resources themselves
    # it discovers from /apis, which every authenticated user may read.
    Rule(("apiextensions.k8s.io",), ("customresourcedefinitions",), ("list", "watch"),
         cluster_scoped=True),
    # A namespaced kopf lists and watches namespaces to serve them as they come and go.
    Rule(("",), ("namespaces",), ("list", "watch"), cluster_scoped=True, mode="namespaced"),
    # Node notices: a cordon or a listed taint on a worker's node (k8s.nodes), in both modes.
    Rule(("",), ("nodes",), ("list", "watch"), cluster_scoped=True, notices=True),
    # Kueue (k8s.kueue): the jobs' Workloads and the namespaces' LocalQueues, then read only
    # what admissions and priorities name.
    Rule(("kueue.x-k8s.io",), ("workloads",), ("get", "list", "watch", "create", "patch"),
         kueue=True),
    Rule(("kueue.x-k8s.io",), ("workloads/status",), ("patch",), kueue=True),
    Rule(("kueue.x-k8s.io",), ("localqueues",), ("list", "watch"), kueue=True),
    Rule(("kueue.x-k8s.io",), ("resourceflavors",), ("get", "list", "watch"),
         cluster_scoped=True, kueue=True),
    Rule(("kueue.x-k8s.io",), ("workloadpriorityclasses",), ("get",), cluster_scoped=True,
         kueue=True),
    # Shrink to yield (policy.kueue_yield): each ClusterQueue's preemption policy.
    Rule(("kueue.x-k8s.io",), ("clusterqueues",), ("list", "watch"), cluster_scoped=True,
         kueue=True),
    Rule(("scheduling.k8s.io",), ("priorityclasses",), ("get",), cluster_scoped=True,
         kueue=True),
)


def rules_for(mode: Mode, *, peering: bool, notices: bool = True,
              kueue: bool = True) -> tuple[Rule, ...]:
    """The rules an operator in `mode` (with or without kopf peering, reading node notices or
    not, following Kueue or not) needs."""
    return tuple(r for r in RULES
                 if r.mode in (None, mode) and (peering or not r.peering)
                 and (notices or not r.notices) and (kueue or not r.kueue))
