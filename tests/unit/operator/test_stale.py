"""Stale worker pods (policy.stale): a graceful delete, a force-delete only where no kubelet
will confirm the end (the node lost, or the grace long over)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from elastrain_operator.k8s.nodes import NodeNotices
from elastrain_operator.model.names import LABEL_ATTEMPT, LABEL_INDEX
from elastrain_operator.policy.failures import WorkerPod, read_worker_pod
from elastrain_operator.policy.stale import (
    OVERDUE_SECONDS,
    Removal,
    lost_under,
    node_lost,
    node_lost_since,
    removal,
)

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)


def node(*, ready: str | None = "True", reason: str = "", taints: tuple[str, ...] = (),
         effect: str = "NoExecute") -> dict[str, object]:
    conditions = [] if ready is None else [{"type": "Ready", "status": ready, "reason": reason}]
    return {"metadata": {"name": "n1"},
            "spec": {"taints": [{"key": k, "effect": effect} for k in taints]},
            "status": {"conditions": conditions}}


def test_a_node_is_lost_when_not_ready_or_tainted_by_the_node_controller() -> None:
    assert node_lost(node()) is None
    assert node_lost(node(ready=None)) is None  # just registered: no word yet
    assert node_lost(node(ready="False", reason="KubeletNotReady")) == \
        "Ready=False (KubeletNotReady)"
    assert node_lost(node(ready="Unknown")) == "Ready=Unknown"
    assert node_lost(node(taints=("node.kubernetes.io/unreachable",))) == \
        "taint node.kubernetes.io/unreachable"
    # The NoSchedule twin comes with any new node; only the NoExecute one says it is gone.
    assert node_lost(node(taints=("node.kubernetes.io/not-ready",), effect="NoSchedule")) is None
    assert node_lost(node(taints=("karpenter.sh/disrupted",))) is None


def test_a_lost_nodes_loss_began_when_its_taint_was_added_else_when_it_went_not_ready(
        ) -> None:
    tainted = node(ready="Unknown", taints=("node.kubernetes.io/unreachable",))
    tainted["spec"]["taints"][0]["timeAdded"] = "2026-01-01T11:59:00Z"  # type: ignore[index]
    tainted["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T11:58:50Z"  # type: ignore[index]
    assert node_lost_since(tainted) == NOW - timedelta(seconds=60)
    untainted = node(ready="False")
    untainted["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T11:58:50Z"  # type: ignore[index]
    assert node_lost_since(untainted) == NOW - timedelta(seconds=70)
    assert node_lost_since(node(ready=None)) is None
    notices = NodeNotices(())
    assert notices.put(tainted) and notices.lost_since_of(["n1", "n2"]) == {
        "n1": NOW - timedelta(seconds=60)}
    assert notices.put(node()) and notices.lost_since_of(["n1"]) == {}
    # A pod created after the loss began is not the lost node's; one created before, or with
    # no time said, is.
    lost, since = {"n1": "taint x"}, {"n1": NOW}
    assert lost_under(NOW + timedelta(seconds=1), "n1", lost, since) is None
    assert lost_under(NOW - timedelta(seconds=1), "n1", lost, since) == "taint x"
    assert lost_under(None, "n1", lost, since) == "taint x"
    assert lost_under(NOW + timedelta(seconds=1), "n1", lost, {}) == "taint x"
    assert lost_under(NOW, "n2", lost, since) is None


def pod(*, on: str = "n1", deleting_until: datetime | None = None) -> WorkerPod:
    return WorkerPod(name="w", index=0, attempt=0, phase="Running", node=on,
                     deleting=deleting_until is not None, deletion_deadline=deleting_until)


def test_a_stale_pod_is_deleted_gracefully_and_forced_only_without_a_kubelet() -> None:
    assert removal(pod(), {}, NOW) is Removal.DELETE
    assert removal(pod(), {"n2": "Ready=False"}, NOW) is Removal.DELETE
    assert removal(pod(), {"n1": "Ready=False"}, NOW) is Removal.FORCE
    # A graceful delete under way is left to its kubelet ...
    ends = NOW + timedelta(seconds=20)
    assert removal(pod(deleting_until=ends), {}, NOW) is None
    assert removal(pod(deleting_until=ends), {}, ends + timedelta(seconds=OVERDUE_SECONDS - 1)) \
        is None
    # ... until it is long overdue (no right to read nodes, or the node not marked yet) ...
    assert removal(pod(deleting_until=ends), {}, ends + timedelta(seconds=OVERDUE_SECONDS)) \
        is Removal.FORCE
    # ... or its node is known lost.
    assert removal(pod(deleting_until=ends), {"n1": "taint x"}, NOW) is Removal.FORCE
    assert removal(pod(on=""), {"": "?"}, NOW) is Removal.DELETE  # never scheduled


def test_the_deadline_is_read_from_the_pod() -> None:
    manifest = {"metadata": {"name": "w", "labels": {LABEL_INDEX: "0", LABEL_ATTEMPT: "1"},
                             "deletionTimestamp": "2026-01-01T12:00:30Z"},
                "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}
    read = read_worker_pod(manifest, "f")
    assert read is not None and read.deletion_deadline == NOW + timedelta(seconds=30)


def test_the_node_watch_keeps_lost_nodes_and_says_when_that_changes() -> None:
    nodes = NodeNotices(("karpenter.sh/disrupted",))
    assert not nodes.put(node())
    assert nodes.put(node(ready="Unknown"))
    assert not nodes.put(node(ready="Unknown"))
    assert nodes.lost_of(["n1", "n2"]) == {"n1": "Ready=Unknown"} and nodes.of(["n1"]) == {}
    assert nodes.put(node())
    assert nodes.lost_of(["n1"]) == {}
    nodes.put(node(ready="False"))
    assert nodes.remove("n1") and nodes.lost_of(["n1"]) == {}
