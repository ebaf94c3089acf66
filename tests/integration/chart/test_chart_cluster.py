"""The chart on the tests' real kube-apiserver: it installs for every ci values file, its
objects pass strict server-side validation, and the operator's ServiceAccount can do exactly
what elastrain_operator.rbac.RULES lists and nothing it should not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.integration.chart.conftest import Installer, helm
from tests.integration.conftest import kubectl
from tests.unit.chart.chartlib import CHART, CI_VALUES, operator_rules, render_text

pytestmark = pytest.mark.cluster

SA_NAME = "elastrain"  # fullnameOverride below, so names do not depend on the release


def _ensure_namespaces(kube: Any, names: list[str]) -> None:
    for name in names:
        if kubectl(kube, "get", "namespace", name, check=False).returncode != 0:
            kubectl(kube, "create", "namespace", name)


def _watched(values: Path) -> list[str]:
    data = yaml.safe_load(values.read_text()) or {}
    return sorted(ns for ns, on in data.get("operator", {}).get("watchNamespaces", {}).items()
                  if on)


@pytest.mark.parametrize("values", CI_VALUES, ids=[p.stem for p in CI_VALUES])
def test_rendered_chart_passes_strict_server_side_validation(
        monitoring_crds: Any, kube_namespace: str, values: Path) -> None:
    _ensure_namespaces(monitoring_crds, _watched(values))
    # CRDs first, for real: a dry-run does not create them, so their kinds would be unknown.
    kubectl(monitoring_crds, "apply", "--server-side", "--force-conflicts",
            "-f", str(CHART / "crds"))
    manifest = render_text(values=[values], namespace=kube_namespace, include_crds=False)
    done = kubectl(monitoring_crds, "apply", "--server-side", "--dry-run=server",
                   "--validate=strict", "--field-manager=chart-test", "-f", "-",
                   input_text=manifest, check=False)
    assert done.returncode == 0, done.stderr


def test_strict_validation_refuses_a_misspelled_monitor_field(
        monitoring_crds: Any, kube_namespace: str) -> None:
    """The stand-in monitoring CRDs really check field names (or the test above proves little)."""
    manifest = render_text(sets=["metrics.serviceMonitor.enabled=true"],
                           namespace=kube_namespace, include_crds=False)
    broken = manifest.replace("scrapeTimeout:", "scrapeTimout:")
    assert broken != manifest
    done = kubectl(monitoring_crds, "apply", "--server-side", "--dry-run=server",
                   "--validate=strict", "-f", "-", input_text=broken, check=False)
    assert done.returncode != 0 and "scrapeTimout" in done.stderr


@pytest.mark.parametrize("values", CI_VALUES, ids=[p.stem for p in CI_VALUES])
def test_helm_install_on_the_real_apiserver(install_chart: Installer, monitoring_crds: Any,
                                            kube_namespace: str, values: Path) -> None:
    _ensure_namespaces(monitoring_crds, _watched(values))
    _, done = install_chart(kube_namespace, "--values", str(values),
                                  "--set", f"fullnameOverride=et-{kube_namespace[-8:]}")
    assert "STATUS: deployed" in done.stdout
    assert "kubectl get trainingjobs" in done.stdout  # NOTES.txt rendered
    # Trainers scraped, but no scraper named that the jobs' NetworkPolicies would let in.
    scraped = (yaml.safe_load(values.read_text()) or {}).get("metrics", {}).get(
        "trainerPodMonitor", {}).get("enabled", False)
    assert ("networkPolicy.scrapers" in done.stdout) == scraped, done.stdout
    objects = json.loads(kubectl(monitoring_crds, "get", "deployment,serviceaccount",
                                 "-n", kube_namespace, "-o", "json").stdout)["items"]
    assert {o["kind"] for o in objects} >= {"Deployment", "ServiceAccount"}


def test_the_control_key_is_made_once_and_kept_across_upgrades(
        install_chart: Installer, monitoring_crds: Any, kube_namespace: str) -> None:
    """Each in-process job's control token is an HMAC under this key (control.py): a new key at
    an upgrade would lock the operator out of every running job."""
    name = f"ck-{kube_namespace[-8:]}"

    def key() -> str:
        secret = json.loads(kubectl(monitoring_crds, "get", "secret", f"{name}-control-key",
                                    "-n", kube_namespace, "-o", "json").stdout)
        return str(secret["data"]["key"])

    release, _ = install_chart(kube_namespace, "--set", f"fullnameOverride={name}")
    before = key()
    helm(monitoring_crds, "upgrade", release, str(CHART), "--namespace", kube_namespace,
         "--set", f"fullnameOverride={name}", "--set", "replicaCount=1")
    assert key() == before


# --- the operator's identity ---------------------------------------------------------------

@pytest.fixture
def operator_identity(install_chart: Installer, kube_namespace: str,
                      monitoring_crds: Any) -> Iterator[str]:
    """The chart installed cluster-wide; yields the --as user of its ServiceAccount."""
    install_chart(kube_namespace, "--set", f"fullnameOverride={SA_NAME}")
    yield f"system:serviceaccount:{kube_namespace}:{SA_NAME}"


CLUSTER_SCOPED = {"namespaces", "nodes", "customresourcedefinitions", "clusterkopfpeerings",
                  "resourceflavors", "workloadpriorityclasses", "priorityclasses"}


def can_i(kube: Any, user: str, verb: str, group: str, resource: str, namespace: str) -> bool:
    name, _, sub = resource.partition("/")
    target = f"{name}.{group}" if group else name
    args = ["auth", "can-i", verb, target, "--as", user]
    if sub:
        args += ["--subresource", sub]
    if name not in CLUSTER_SCOPED:
        args += ["--namespace", namespace]
    done = kubectl(kube, *args, check=False)
    assert done.stdout.strip() in ("yes", "no"), done.stderr
    return done.stdout.strip() == "yes"


def test_operator_can_do_everything_in_rules(operator_identity: str, monitoring_crds: Any,
                                             kube_namespace: str, kueue: Any) -> None:
    # `kueue`: its CRDs on this apiserver, or kubectl cannot name the Kueue resources.
    # A namespace other than the release's: the operator works in every namespace.
    other = "default"
    denied = [rule for rule in sorted(operator_rules("cluster-wide", peering=False))
              if not can_i(monitoring_crds, operator_identity, rule[2], rule[0], rule[1], other)]
    assert not denied


def test_a_namespaced_operator_acts_only_in_its_namespaces(
        install_chart: Installer, monitoring_crds: Any, kube_namespace: str, kueue: Any) -> None:
    """operator.watchNamespaces: its Roles grant everything it needs there, and nothing touches a
    pod, Service or NetworkPolicy anywhere else (no cluster-wide pod create)."""
    install_chart(kube_namespace, "--set", f"fullnameOverride={SA_NAME}",
                  "--set", f"operator.watchNamespaces.{kube_namespace}=true")
    user = f"system:serviceaccount:{kube_namespace}:{SA_NAME}"
    rules = operator_rules("namespaced", peering=False)
    denied = [rule for rule in sorted(rules)
              if not can_i(monitoring_crds, user, rule[2], rule[0], rule[1], kube_namespace)]
    assert not denied
    elsewhere = [rule for rule in sorted(operator_rules("namespaced", peering=False,
                                                        cluster_scoped=False))
                 if can_i(monitoring_crds, user, rule[2], rule[0], rule[1], "default")]
    assert not elsewhere
    for verb, resource in [("create", "pods"), ("list", "pods"),
                           ("create", "networkpolicies.networking.k8s.io")]:
        done = kubectl(monitoring_crds, "auth", "can-i", verb, resource, "--all-namespaces",
                       "--as", user, check=False)
        assert done.stdout.strip() == "no", (verb, resource, done.stdout, done.stderr)


@pytest.mark.parametrize(("verb", "group", "resource"), [
    ("get", "", "secrets"),
    ("delete", "", "secrets"),
    ("get", "", "nodes"),  # notices list and watch them, nothing more
    ("patch", "", "nodes"),
    ("create", "", "pods/exec"),
    ("create", "rbac.authorization.k8s.io", "clusterrolebindings"),
    ("delete", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("create", "elastrain.dev", "trainingjobs"),
    ("update", "", "pods"),
    ("delete", "", "services"),
    ("create", "apps", "deployments"),
])
def test_operator_cannot_do_what_it_should_not(operator_identity: str, monitoring_crds: Any,
                                               verb: str, group: str, resource: str) -> None:
    assert (group, resource, verb) not in operator_rules()
    assert not can_i(monitoring_crds, operator_identity, verb, group, resource, "default")


def _impersonating(kube: Any, user: str) -> client.ApiClient:
    api = kube.api_client()
    api.set_default_header("Impersonate-User", user)
    return api


def test_operator_identity_really_patches_status_and_is_refused_secrets(
        operator_identity: str, monitoring_crds: Any, kube_namespace: str) -> None:
    from tests.unit.operator.builders import make_job_manifest

    with monitoring_crds.api_client() as admin:
        client.CustomObjectsApi(admin).create_namespaced_custom_object(
            "elastrain.dev", "v1alpha1", kube_namespace, "trainingjobs",
            make_job_manifest("rbac-probe"))
        client.CoreV1Api(admin).create_namespaced_secret(kube_namespace, client.V1Secret(
            metadata=client.V1ObjectMeta(name="not-for-the-operator"), string_data={"k": "v"}))
    with _impersonating(monitoring_crds, operator_identity) as api:
        custom = client.CustomObjectsApi(api)
        jobs = custom.list_cluster_custom_object("elastrain.dev", "v1alpha1", "trainingjobs")
        assert any(j["metadata"]["name"] == "rbac-probe" for j in jobs["items"])
        patched = custom.patch_namespaced_custom_object_status(
            "elastrain.dev", "v1alpha1", kube_namespace, "trainingjobs", "rbac-probe",
            {"status": {"phase": "Running"}})
        assert patched["status"]["phase"] == "Running"
        core = client.CoreV1Api(api)
        assert core.list_node().items is not None  # node notices (k8s.nodes): read only
        for forbidden in (lambda: core.delete_namespaced_secret("not-for-the-operator",
                                                                kube_namespace),
                          lambda: core.read_namespaced_secret("not-for-the-operator",
                                                              kube_namespace),
                          lambda: core.patch_node("any", {"spec": {"unschedulable": True}})):
            with pytest.raises(ApiException) as err:
                forbidden()
            assert err.value.status == 403


def test_namespaced_operator_is_confined_to_its_namespaces(
        install_chart: Installer, monitoring_crds: Any, kube_namespace: str) -> None:
    watched = f"{kube_namespace}-w"[:63]
    _ensure_namespaces(monitoring_crds, [watched])
    try:
        install_chart(kube_namespace, "--set", f"fullnameOverride={SA_NAME}",
                      "--set", f"operator.watchNamespaces.{watched}=true")
        user = f"system:serviceaccount:{kube_namespace}:{SA_NAME}"
        assert can_i(monitoring_crds, user, "list", "", "pods", watched)
        assert can_i(monitoring_crds, user, "patch", "elastrain.dev", "trainingjobs/status",
                     watched)
        assert not can_i(monitoring_crds, user, "list", "", "pods", "default")
        assert not can_i(monitoring_crds, user, "patch", "elastrain.dev", "trainingjobs/status",
                         "default")
    finally:
        kubectl(monitoring_crds, "delete", "namespace", watched, "--wait=false", check=False)
