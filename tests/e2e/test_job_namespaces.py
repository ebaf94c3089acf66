"""The namespaces the e2e jobs run in: the operator's pool, fixed at install time.

They enforce the `restricted` Pod Security level through the apiserver's own PodSecurity
admission (no simulation): a hand-made pod without a securityContext is refused there, so the
label is known to bite, and a hardened one (support.restricted_pod) is admitted and runs as the
images' user. The operator's own namespace enforces it too. The chart holds a Role in each, and
the pool hands them out in turn and empties them between tests.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import (
    CREDENTIALS_SECRET,
    OPERATOR_NAMESPACE,
    RELEASE,
    RESTRICTED,
    NamespacePool,
    NodeCluster,
)
from tests.e2e.support import restricted_pod, wait_for


def _phase(node: NodeCluster, ns: str, pod: str) -> str:
    return str(node.kubectl.json("get", "pod", pod, "-n", ns)["status"].get("phase", ""))


def test_a_job_namespace_refuses_an_unhardened_pod_and_admits_a_hardened_one(
        operator: NodeCluster, job_namespace: str) -> None:
    node, ns, k = operator, job_namespace, operator.kubectl
    for namespace in (ns, OPERATOR_NAMESPACE):
        labels = k.json("get", "namespace", namespace)["metadata"]["labels"]
        assert RESTRICTED.items() <= labels.items(), (namespace, labels)

    image = node.images["operator"]
    bare = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "unhardened", "namespace": ns},
            "spec": {"restartPolicy": "Never", "containers": [{
                "name": "c", "image": image, "imagePullPolicy": "Never",
                "command": ["id", "-u"]}]}}
    refused = k("apply", "-f", "-", input_text=json.dumps(bare), check=False)
    print(refused.stderr)
    assert refused.returncode != 0, refused.stdout
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
    for reason in ("allowPrivilegeEscalation != false", "unrestricted capabilities",
                   "runAsNonRoot != true", "seccompProfile"):
        assert reason in refused.stderr, reason
    assert k("get", "pod", "unhardened", "-n", ns, check=False).returncode != 0

    k.apply(restricted_pod("hardened", ns, image=image, command=["id", "-u"]))
    wait_for("the hardened pod to finish",
             lambda: _phase(node, ns, "hardened") in ("Succeeded", "Failed"), timeout=120)
    assert _phase(node, ns, "hardened") == "Succeeded"
    assert k("logs", "hardened", "-n", ns).stdout.strip() == "65532"

    # The operator runs in a restricted namespace of its own (the chart's pod is hardened).
    pods = k.json("get", "pods", "-n", OPERATOR_NAMESPACE, "-l",
                  "app.kubernetes.io/name=elastrain")["items"]
    assert [p["status"]["phase"] for p in pods] == ["Running"], pods


def _names(node: NodeCluster, ns: str, kinds: str) -> set[str]:
    return {item["metadata"]["name"] for item in node.kubectl.json("get", kinds, "-n", ns)["items"]}


def test_the_pool_hands_out_its_watched_namespaces_in_turn_and_empties_them(
        operator: NodeCluster, namespace_pool: NamespacePool) -> None:
    node, k = operator, operator.kubectl
    taken = [namespace_pool.take() for _ in namespace_pool.names]
    assert sorted(taken) == sorted(namespace_pool.names)
    with pytest.raises(AssertionError, match="are taken"):
        namespace_pool.take()
    for ns in taken:  # the operator may act there, and only through the chart's Role
        assert _names(node, ns, "roles") == {RELEASE}
        assert _names(node, ns, "rolebindings") == {f"{RELEASE}-operator"}
    first = taken[0]
    k("create", "configmap", "leftover", "-n", first, "--from-literal=a=b")
    k("create", "secret", "generic", "leftover", "-n", first, "--from-literal=a=b")
    k.apply(restricted_pod("leftover", first, image=node.images["pause"], command=["/pause"]))
    for ns in taken:
        namespace_pool.give_back(ns)

    assert namespace_pool.take() == first  # in turn: the oldest given back comes first
    try:
        assert not k("get", "pods", "-n", first, "-o", "name").stdout.strip()
        assert "leftover" not in _names(node, first, "configmaps")
        assert _names(node, first, "secrets") == {CREDENTIALS_SECRET}
    finally:
        namespace_pool.give_back(first)
