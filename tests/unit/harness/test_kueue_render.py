"""What hack/kueue.py registers on the apiserver: pure renderers, checked without Kueue or a
cluster.

The point of each check: a webhook that fails closed must never reach a namespace Kueue does not
manage, and every webhook must call the manager's loopback URL, not a Service.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
URL = "https://127.0.0.1:4443"


@pytest.fixture(scope="module")
def kueue() -> ModuleType:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("hack.kueue")


def _webhook(name: str, path: str, group: str, resource: str) -> dict[str, Any]:
    return {"name": name, "failurePolicy": "Fail", "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "clientConfig": {"service": {"name": "webhook-service", "namespace": "system",
                                         "path": path}},
            "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": [resource]}]}


UPSTREAM: list[dict[str, Any]] = [{"apiVersion": "admissionregistration.k8s.io/v1",
             "kind": "MutatingWebhookConfiguration",
             "metadata": {"name": "mutating-webhook-configuration"},
             "webhooks": [_webhook("mjob.kb.io", "/mutate-batch-v1-job", "batch", "jobs"),
                          _webhook("mpod.kb.io", "/mutate--v1-pod", "", "pods"),
                          _webhook("mdeployment.kb.io", "/mutate-apps-v1-deployment", "apps",
                                   "deployments"),
                          _webhook("mworkload.kb.io", "/mutate-kueue-x-k8s-io-v1beta2-workload",
                                   "kueue.x-k8s.io", "workloads")]}]


def test_only_the_enabled_kinds_webhooks_are_kept_each_calling_the_loopback_url(
        kueue: ModuleType) -> None:
    [config] = kueue.render_webhook_configurations(UPSTREAM, url=URL, ca_bundle="Q0E=")
    assert config["metadata"]["name"] == "kueue-mutating-webhook-configuration"
    by_name = {w["name"]: w for w in config["webhooks"]}
    assert sorted(by_name) == ["mjob.kb.io", "mpod.kb.io", "mworkload.kb.io"]
    assert by_name["mpod.kb.io"]["clientConfig"] == {"url": URL + "/mutate--v1-pod",
                                                     "caBundle": "Q0E="}


def test_job_and_pod_webhooks_see_only_kueue_namespaces_and_kueues_own_kinds_see_all(
        kueue: ModuleType) -> None:
    [config] = kueue.render_webhook_configurations(UPSTREAM, url=URL, ca_bundle="Q0E=")
    selectors = {w["name"]: w.get("namespaceSelector") for w in config["webhooks"]}
    only_kueue = {"matchLabels": {"elastrain.dev/kueue": "true"}}
    assert selectors == {"mjob.kb.io": only_kueue, "mpod.kb.io": only_kueue,
                         "mworkload.kb.io": None}
    assert UPSTREAM[0]["webhooks"][0]["clientConfig"].get("url") is None  # input untouched


def test_the_managers_config_matches_the_webhooks_namespaces(kueue: ModuleType) -> None:
    config = kueue.render_config(webhook_port=1, health_port=2, metrics_port=3,
                                 cert_dir=Path("/c"))
    assert config["managedJobsNamespaceSelector"] == kueue.namespace_selector()
    assert config["internalCertManagement"] == {"enable": False}
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["webhook"] == {"host": "127.0.0.1", "port": 1, "certDir": "/c"}
    assert config["integrations"]["frameworks"] == ["batch/job", "pod"]
    assert config["integrations"]["externalFrameworks"] == ["TrainingJob.v1alpha1.elastrain.dev"]


def _crd(plural: str) -> dict[str, Any]:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kueue.x-k8s.io"},
            "spec": {"names": {"plural": plural}, "versions": []}}


def test_conversion_is_wired_where_upstream_wires_it(kueue: ModuleType) -> None:
    workloads = kueue.render_crd(_crd("workloads"), url=URL, ca_bundle="Q0E=")
    assert workloads["spec"]["conversion"] == {"strategy": "Webhook", "webhook": {
        "clientConfig": {"url": URL + "/convert", "caBundle": "Q0E="},
        "conversionReviewVersions": ["v1"]}}
    flavors = kueue.render_crd(_crd("resourceflavors"), url=URL, ca_bundle="Q0E=")
    assert "conversion" not in flavors["spec"]
