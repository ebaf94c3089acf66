"""kopf settings in one startup handler, and the runtime options __main__ hands over.

- Progress and diff-base in annotations (prefix elastrain.dev): the structural status schema
  would prune kopf's default `status.kopf`, and the status is ours alone. No diff-base is
  built (NoDiffBase): kopf deep-copies every watched object on every event to detect changes
  for change handlers, and this operator has none.
- Watch timeouts so a silently dead watch connection is noticed and re-established.
- The work queue's threads (ELASTRAIN_WORKERS) and a client connection pool as large as them.
- Peering: the operator creates its KopfPeering object (per watched namespace) or
  ClusterKopfPeering when missing, so HA needs only the peering CRDs (crds/kopf-peering.yaml).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import kopf

from elastrain_operator import metrics
from elastrain_operator.control import load_key
from elastrain_operator.k8s.cache import Cache, Key
from elastrain_operator.k8s.client import Kube, KubeError, load_api_client
from elastrain_operator.k8s.kueue import KueueState
from elastrain_operator.k8s.nodes import NodeNotices
from elastrain_operator.network_settings import NetworkPolicySettings
from elastrain_operator.reconcile import Options, reconcile_if_needed
from elastrain_operator.tickers import Tickers
from elastrain_operator.workqueue import WorkQueue

log = logging.getLogger(__name__)
PEERING_GROUP_VERSION = "kopf.dev/v1"


def env_seconds(name: str, default: float) -> float:
    """Test and tuning knobs: ELASTRAIN_* seconds from the environment."""
    return float(os.environ.get(name, default))


TIMER_INTERVAL_SECONDS = env_seconds("ELASTRAIN_TIMER_INTERVAL_SECONDS", 5.0)
PROGRESS_INTERVAL_SECONDS = env_seconds("ELASTRAIN_PROGRESS_INTERVAL_SECONDS", 15.0)
HANDLER_BACKOFF_SECONDS = env_seconds("ELASTRAIN_HANDLER_BACKOFF_SECONDS", 2.0)
WORKERS = int(os.environ.get("ELASTRAIN_WORKERS", "8"))


@dataclass
class RuntimeOptions:
    """What the command line decided; carried to handlers in kopf's memo."""

    standalone: bool = False
    peering_name: str = "elastrain"
    priority: int = 0
    clusterwide: bool = False
    namespaces: list[str] = field(default_factory=list)
    metrics_port: int = 0
    peering_lifetime_seconds: int = 60
    network: NetworkPolicySettings = field(default_factory=NetworkPolicySettings)
    notice_taints: tuple[str, ...] | None = None  # k8s.nodes; None: notices off
    notices_off: str = ""  # why they are off though asked for (no right to read nodes)
    kueue_served: bool = False  # the apiserver serves Kueue's v1beta2 API (k8s.kueue)
    kueue_yield: bool = False  # shrink to yield (policy.kueue_yield)
    kueue_slices: bool = False  # grow through workload slices (policy.kueue_slices)


@dataclass
class OperatorState:
    """The per-process objects handlers share (a client, not cluster state)."""

    kube: Kube | None = None
    cache: Cache = field(default_factory=Cache)
    queue: WorkQueue | None = None
    tickers: Tickers = field(default_factory=Tickers)
    last_progress_poll: dict[str, float] = field(default_factory=dict)
    network: NetworkPolicySettings = field(default_factory=NetworkPolicySettings)
    control_key: bytes | None = None  # control.py; loaded at startup
    notices: NodeNotices | None = None  # k8s.nodes; None: notices off
    notices_off: str = ""
    kueue: KueueState | None = None  # k8s.kueue; set at startup
    _deleted: dict[Key, set[str]] = field(default_factory=dict)  # key -> uids of deleted jobs
    _deleted_lock: threading.Lock = field(default_factory=threading.Lock)

    def job_deleted(self, key: Key, uid: str) -> None:
        """The watch saw the job go: the metrics forget it after the key's next round."""
        with self._deleted_lock:
            self._deleted.setdefault(key, set()).add(uid)

    def handle(self, key: Key, poll: bool) -> None:
        """What a queue thread runs for one job."""
        assert self.kube is not None
        try:
            network = self.network.peers if self.network.enabled else None
            reconcile_if_needed(self.kube, key, Options(poll_progress=poll, cache=self.cache,
                                                        network=network,
                                                        control_key=self.control_key,
                                                        notices=self.notices,
                                                        notices_off=self.notices_off,
                                                        kueue=self.kueue))
        finally:
            # Here rather than on the DELETED event: a round of the job in flight then would
            # record it again after. Rounds of one key never overlap, and the event queues one.
            with self._deleted_lock:
                deleted = self._deleted.pop(key, set())
            for uid in deleted:
                metrics.record_job(uid, None)


def _ensure_peering(kube: Kube, options: RuntimeOptions) -> None:
    name = options.peering_name
    body: dict[str, Any] = {"apiVersion": PEERING_GROUP_VERSION, "metadata": {"name": name}}
    try:
        if options.clusterwide:
            kube.create(f"/apis/{PEERING_GROUP_VERSION}/clusterkopfpeerings",
                        {**body, "kind": "ClusterKopfPeering"})
            return
        for ns in options.namespaces:
            if any(ch in ns for ch in "*?[!"):
                continue  # a pattern, not a namespace: its peering objects are the admin's job
            kube.create(f"/apis/{PEERING_GROUP_VERSION}/namespaces/{ns}/kopfpeerings",
                        {**body, "kind": "KopfPeering",
                         "metadata": {"name": name, "namespace": ns}})
    except KubeError as err:
        log.error("cannot create the kopf peering object %r (are crds/kopf-peering.yaml "
                  "installed?): %s", name, err)


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff-base serves change handlers (on.create/update/resume/delete/field); every
    handler here is on.event or the per-job ticker daemon, which read no diff. Building it
    deep-copies the whole object (status and managedFields included) on every watch event of
    every pod, Service and job: 11% of the operator's CPU while 1000 jobs' children were created."""

    def build(self, *, body: kopf.Body,
              extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


def configure(*, settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    options: RuntimeOptions = memo.options
    state: OperatorState = memo.state
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix="elastrain.dev")
    settings.persistence.diffbase_storage = NoDiffBase(
        prefix="elastrain.dev", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own events say what happened
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 10
    settings.peering.stealth = True
    settings.peering.lifetime = options.peering_lifetime_seconds
    settings.execution.max_workers = 4  # kopf's own threads: our handlers are async
    # A job deleted while something holds it (foreground deletion, another finalizer) shows a
    # deletionTimestamp, and kopf stops its ticker, re-checking whether it has exited only
    # every cancellation_polling seconds (60 by default). Any other deletion: tickers.py.
    settings.background.cancellation_polling = 1.0
    state.network = options.network
    state.control_key = load_key()
    if options.notice_taints is not None:
        state.notices = NodeNotices(options.notice_taints)
    state.notices_off = options.notices_off
    state.kueue = KueueState(served=options.kueue_served, yielding=options.kueue_yield,
                             slices=options.kueue_slices)
    if options.network.enabled and options.network.peers.operator is None:
        log.warning("ELASTRAIN_NETWORK_POLICY_OPERATOR_PEER is unset: each job's NetworkPolicy "
                    "leaves the workers' metrics/progress port open to every pod")
    state.kube = Kube(load_api_client(pool_size=WORKERS + 4))
    state.queue = WorkQueue(state.handle, workers=WORKERS, retry_seconds=HANDLER_BACKOFF_SECONDS)
    state.queue.start()
    if not options.standalone:
        _ensure_peering(state.kube, options)
    metrics.serve(options.metrics_port)
