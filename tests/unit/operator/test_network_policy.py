"""The job's NetworkPolicy: rendered against inline YAML, planned like the other children, and
the operator's settings for it read from the environment."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from elastrain_operator.k8s.cache import build_children
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.network_settings import (
    OPERATOR_PEER_VAR,
    SCRAPERS_VAR,
    read_network_settings,
)
from elastrain_operator.policy.planning import Observed, plan
from elastrain_operator.render.network import MetricsPeers, render_network_policy

NOW = datetime(2026, 1, 1, tzinfo=UTC)
OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "elastrain"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "elastrain-operator"}}}
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def job(**spec: Any) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"image": "trainer:dev", "replicas": 2, "maxReplicas": 4, **spec}})


POLICY = yaml.safe_load("""
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: demo-network
  namespace: ml
  labels:
    app.kubernetes.io/name: elastrain
    app.kubernetes.io/managed-by: elastrain-operator
    elastrain.dev/job-name: demo
    elastrain.dev/role: network-policy
  ownerReferences:
  - {apiVersion: elastrain.dev/v1alpha1, kind: TrainingJob, name: demo, uid: uid-1,
     controller: true, blockOwnerDeletion: true}
spec:
  podSelector:
    matchLabels: {elastrain.dev/job-name: demo}
  policyTypes: [Ingress]
  ingress:
  - from:
    - podSelector:
        matchLabels: {elastrain.dev/job-name: demo, elastrain.dev/role: worker}
  - ports: [{protocol: TCP, port: 9400}]
    from:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: elastrain}}
      podSelector: {matchLabels: {app.kubernetes.io/name: elastrain-operator}}
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}
""")


def test_the_store_and_workers_accept_the_jobs_workers_and_the_metrics_port_its_peers() -> None:
    peers = MetricsPeers(operator=OPERATOR, scrapers=(PROMETHEUS,))
    assert render_network_policy(job(), peers) == POLICY


def test_no_operator_peer_leaves_only_the_metrics_port_open_to_all() -> None:
    rules = render_network_policy(job(metricsPort=9500), MetricsPeers())["spec"]["ingress"]
    assert rules == [POLICY["spec"]["ingress"][0],
                     {"ports": [{"protocol": "TCP", "port": 9500}]}]


def test_metrics_port_off_means_only_the_workers_rule() -> None:
    peers = MetricsPeers(operator=OPERATOR, scrapers=(PROMETHEUS,))
    rules = render_network_policy(job(metricsPort=0), peers)["spec"]["ingress"]
    assert rules == [POLICY["spec"]["ingress"][0]]


def test_egress_is_left_alone() -> None:
    spec = render_network_policy(job(), MetricsPeers())["spec"]
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec


# --------------------------------------------------------------------------------- planning


def kinds(observed: Observed, network: MetricsPeers | None) -> list[str]:
    return [m["kind"] for m in plan(job(), observed, now=NOW, network=network).create]


def test_planned_before_any_pod_when_missing() -> None:
    created = kinds(Observed(), MetricsPeers())
    assert created[:4] == ["Service", "Service", "NetworkPolicy", "Pod"]
    assert created.count("NetworkPolicy") == 1


def test_not_planned_when_it_exists_or_when_the_operator_renders_none() -> None:
    assert "NetworkPolicy" not in kinds(Observed(network_policy=True), MetricsPeers())
    assert "NetworkPolicy" not in kinds(Observed(), None)


def test_recreated_when_deleted_without_touching_the_rest() -> None:
    observed = Observed(services=frozenset({"demo-workers", "demo-rdzv"}))
    first = plan(job(), observed, now=NOW, network=MetricsPeers())
    assert [m["kind"] for m in first.create].count("NetworkPolicy") == 1


def test_a_users_policy_of_that_name_is_left_alone() -> None:
    children = build_children({}, {"demo-network": "someone-else"}, job_name="demo", uid="uid-1")
    assert children.observed.network_policy
    assert not children.observed.foreign_services  # not a reason to block the job
    assert "NetworkPolicy" not in kinds(children.observed, MetricsPeers())


# --------------------------------------------------------------------------------- settings


def test_unset_means_on_with_no_peers() -> None:
    settings = read_network_settings({})
    assert settings.enabled and settings.peers == MetricsPeers()


def test_peers_from_json() -> None:
    settings = read_network_settings({
        "ELASTRAIN_NETWORK_POLICY": "true",
        OPERATOR_PEER_VAR: '{"namespaceSelector": {"matchLabels": '
                           '{"kubernetes.io/metadata.name": "elastrain"}}, "podSelector": '
                           '{"matchLabels": {"app.kubernetes.io/name": "elastrain-operator"}}}',
        SCRAPERS_VAR: '[{"namespaceSelector": {"matchLabels": '
                      '{"kubernetes.io/metadata.name": "monitoring"}}}, '
                      '{"ipBlock": {"cidr": "10.0.0.0/8"}}]'})
    assert settings.peers.operator == OPERATOR
    assert settings.peers.scrapers == (PROMETHEUS, {"ipBlock": {"cidr": "10.0.0.0/8"}})


def test_off() -> None:
    assert not read_network_settings({"ELASTRAIN_NETWORK_POLICY": "False"}).enabled


@pytest.mark.parametrize(("env", "message"), [
    ({"ELASTRAIN_NETWORK_POLICY": "yes"}, "ELASTRAIN_NETWORK_POLICY must be"),
    ({OPERATOR_PEER_VAR: "{not json"}, f"{OPERATOR_PEER_VAR} is not valid JSON"),
    ({OPERATOR_PEER_VAR: "[]"}, f"{OPERATOR_PEER_VAR} must be a non-empty NetworkPolicyPeer"),
    ({OPERATOR_PEER_VAR: '{"podselector": {}}'}, f"{OPERATOR_PEER_VAR} has unknown keys"),
    ({OPERATOR_PEER_VAR: '{"podSelector": {"matchLabels": {"a": 1}}}'},
     f"{OPERATOR_PEER_VAR}.podSelector.matchLabels must map strings"),
    ({SCRAPERS_VAR: '{"podSelector": {}}'}, f"{SCRAPERS_VAR} must be a JSON list"),
    ({SCRAPERS_VAR: '[{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]'},
     f"{SCRAPERS_VAR}[0]: ipBlock cannot be combined"),
    ({SCRAPERS_VAR: '[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]'},
     f"{SCRAPERS_VAR}[0].podSelector.matchExpressions"),
])
def test_a_bad_value_names_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_network_settings(env)
