"""The job's NetworkPolicy against a real apiserver and garbage collector: created with the job's
children, owned by the job, left alone when a user changes it, created again when deleted,
collected with the job; none when the operator is told not to; a bad setting stops the operator
at startup naming the variable. (Enforcement is the e2e tier's: tests/e2e/test_network_policy.py.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from elastrain_operator.k8s.client import namespaced
from tests.integration.operator.conftest import Cluster, Operator, wait_for

pytestmark = pytest.mark.cluster
NETWORKING = "networking.k8s.io/v1"
OPERATOR_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "elastrain"}}}
SCRAPER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def policy_path(cluster: Cluster, name: str = "demo-network") -> str:
    return namespaced(NETWORKING, cluster.ns, "networkpolicies", name)


def test_owned_policy_created_kept_as_the_user_left_it_and_collected(
        cluster: Cluster, operator_factory: Callable[..., Operator],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTRAIN_NETWORK_POLICY_OPERATOR_PEER", json.dumps(OPERATOR_PEER))
    monkeypatch.setenv("ELASTRAIN_NETWORK_POLICY_SCRAPERS", json.dumps([SCRAPER]))
    operator_factory().start()
    job = cluster.create_job(replicas=2)
    policy: dict[str, Any] = wait_for("the job's NetworkPolicy",
                                      lambda: cluster.kube.get(policy_path(cluster)))
    (owner,) = policy["metadata"]["ownerReferences"]
    assert owner["uid"] == job["metadata"]["uid"] and owner["controller"] is True
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"elastrain.dev/job-name": "demo"}}
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"elastrain.dev/job-name": "demo",
                                                   "elastrain.dev/role": "worker"}}}]},
        {"from": [OPERATOR_PEER, SCRAPER], "ports": [{"port": 9400, "protocol": "TCP"}]}]
    cluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0"])

    # A user's change stands: the operator only ever creates the policy.
    cluster.kube.patch(policy_path(cluster), {"spec": {"ingress": [{}]}}, kind="merge")
    cluster.patch_spec(replicas=3)  # a round that would rewrite the policy, if anything did
    cluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0", "demo-worker-2-0"])
    assert (cluster.kube.get(policy_path(cluster)) or {})["spec"]["ingress"] == [{}]

    # Deleted: the job gets it back.
    uid = policy["metadata"]["uid"]
    cluster.kube.delete(policy_path(cluster))
    again = wait_for("the NetworkPolicy created again", lambda: (
        p := cluster.kube.get(policy_path(cluster))) and p["metadata"]["uid"] != uid and p)
    assert again["spec"]["ingress"][0] == spec["ingress"][0]

    # The garbage collector takes it with the job.
    cluster.kube.delete(cluster.job_path("demo"), body={"propagationPolicy": "Background"})
    wait_for("the NetworkPolicy collected with its job",
             lambda: cluster.kube.get(policy_path(cluster)) is None, timeout=60)


def test_switched_off_no_policy(cluster: Cluster, operator_factory: Callable[..., Operator],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTRAIN_NETWORK_POLICY", "false")
    op = operator_factory()
    op.start()
    cluster.create_job(replicas=2)
    cluster.wait_workers(["demo-worker-0-0", "demo-worker-1-0"])
    assert cluster.kube.get(policy_path(cluster)) is None
    assert "networkpolicies" not in op.logs()


def test_a_bad_setting_stops_the_operator_naming_it(
        operator_factory: Callable[..., Operator], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTRAIN_NETWORK_POLICY_SCRAPERS", '[{"podSelector": ')
    op = operator_factory()
    op.start()
    assert op.proc is not None
    assert op.proc.wait(60) == 2
    assert "ELASTRAIN_NETWORK_POLICY_SCRAPERS is not valid JSON" in op.logs()
