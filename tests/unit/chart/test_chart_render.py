"""The chart renders, lints and validates offline, and what it renders keeps its promises:
restricted Pod Security, exactly the operator's RBAC, peering before replicas, a PDB that never
blocks drains, monitors that select what the operator and trainer serve."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from tests.unit.chart.chartlib import (
    CHART,
    CI_VALUES,
    ROOT,
    Manifest,
    of_kind,
    one,
    operator_rules,
    render,
    render_error,
    rule_triples,
    run_helm,
)

K8S_SCHEMA_VERSION = "1.34.0"  # the Kubernetes minor the tests' apiserver runs (hack/versions.env)
CI_IDS = [p.stem for p in CI_VALUES]
BUILTIN_GROUPS = ("", "apps", "rbac.authorization.k8s.io", "policy", "apiextensions.k8s.io")


def _group(doc: Manifest) -> str:
    api_version: str = doc["apiVersion"]
    return api_version.split("/")[0] if "/" in api_version else ""


@pytest.fixture(scope="module", params=CI_VALUES, ids=CI_IDS)
def ci_render(request: pytest.FixtureRequest) -> list[Manifest]:
    return render(values=[request.param])


def test_ci_values_files_exist() -> None:
    assert {"default-values", "ha-values", "namespaced-values"} <= set(CI_IDS)


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=["no-values", *CI_IDS])
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)] + (["--values", str(values)] if values else [])
    done = run_helm(*args, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_builtin_kinds_validate_against_kubernetes_schema(ci_render: list[Manifest]) -> None:
    builtin = [d for d in ci_render if _group(d) in BUILTIN_GROUPS]
    assert builtin
    for doc in builtin:
        try:
            kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {err.message} at "
                        f"{'.'.join(map(str, err.path))}")


def test_every_object_is_labelled_and_namespaced_where_it_must_be(
        ci_render: list[Manifest]) -> None:
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                      "ClusterKopfPeering", "ValidatingAdmissionPolicy",
                      "ValidatingAdmissionPolicyBinding"}
    for doc in ci_render:
        meta = doc["metadata"]
        if doc["kind"] == "CustomResourceDefinition":
            continue  # crds/ is installed verbatim
        labels = meta.get("labels", {})
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                    "app.kubernetes.io/managed-by", "helm.sh/chart"):
            assert key in labels, f"{doc['kind']}/{meta['name']} lacks label {key}"
        assert ("namespace" in meta) == (doc["kind"] not in cluster_scoped), doc["kind"]


def test_chart_crds_are_byte_identical_to_the_repository_crds() -> None:
    repo = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert sorted(chart) == sorted(repo), "copy crds/*.yaml to charts/elastrain/crds/"
    stale = [name for name in repo if repo[name] != chart[name]]
    assert not stale, f"charts/elastrain/crds/ is stale for {stale}: run `make chart-crds`"


def test_rendered_crds_are_the_repository_crds() -> None:
    import yaml
    docs = render(include_crds=True)
    rendered = {d["metadata"]["name"]: d for d in of_kind(docs, "CustomResourceDefinition")}
    expected = {d["metadata"]["name"]: d
                for p in (ROOT / "crds").glob("*.yaml")
                for d in yaml.safe_load_all(p.read_text()) if d}
    assert rendered == expected


# --- Pod Security: restricted ----------------------------------------------------------------

def test_operator_pod_is_restricted(ci_render: list[Manifest]) -> None:
    pod = one(ci_render, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in sc["capabilities"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert not sc.get("privileged", False)
    # The only writable path is an emptyDir at /tmp.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/tmp": "tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["tmp"]
    assert not any("hostPath" in v for v in pod["volumes"])
    assert not pod.get("hostNetwork") and not pod.get("hostPID")


@pytest.mark.parametrize("bad", [
    "securityContext.allowPrivilegeEscalation=true",
    "securityContext.runAsNonRoot=false",
    "securityContext.readOnlyRootFilesystem=false",
    "securityContext.seccompProfile.type=Unconfined",
    "podSecurityContext.runAsNonRoot=false",
    "podSecurityContext.runAsUser=0",
    "securityContext.capabilities.add[0]=SYS_ADMIN",
])
def test_schema_refuses_weakening_pod_security(bad: str) -> None:
    render_error(sets=[bad])


def test_liveness_probe_targets_kopf_healthz(ci_render: list[Manifest]) -> None:
    (container,) = one(ci_render, "Deployment")["spec"]["template"]["spec"]["containers"]
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe["path"] == "/healthz"
    assert f"--liveness=http://0.0.0.0:{ports[probe['port']]}/healthz" in container["args"]


# --- peering and replicas ----------------------------------------------------------------------

def _container(docs: list[Manifest]) -> Manifest:
    containers: list[Manifest] = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return containers[0]


def test_default_is_one_standalone_operator_that_never_overlaps() -> None:
    docs = render()
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    args = _container(docs)["args"]
    assert "--standalone" in args and not any(a.startswith("--peering") for a in args)
    assert "--all-namespaces" in args
    assert not of_kind(docs, "ClusterKopfPeering") and not of_kind(docs, "KopfPeering")


def test_more_than_one_replica_requires_peering() -> None:
    error = render_error(sets=["replicaCount=2"])
    assert "peering.enabled" in error


def test_peering_names_the_peering_object_the_chart_creates() -> None:
    assert not of_kind(render(sets=["peering.enabled=true"]), "ClusterKopfPeering"), (
        "by default the operator creates its own peering object")
    docs = render(sets=["replicaCount=3", "peering.enabled=true", "peering.name=prod",
                        "peering.create=true"])
    args = _container(docs)["args"]
    assert "--peering=prod" in args and "--standalone" not in args
    assert one(docs, "ClusterKopfPeering")["metadata"]["name"] == "prod"
    env = {e["name"]: e for e in _container(docs)["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_namespaced_operator_peers_in_each_watched_namespace() -> None:
    docs = render(sets=["peering.enabled=true", "peering.create=true",
                        "operator.watchNamespaces.a=true",
                        "operator.watchNamespaces.b=true", "operator.watchNamespaces.c=false"])
    assert sorted(p["metadata"]["namespace"] for p in of_kind(docs, "KopfPeering")) == ["a", "b"]
    args = _container(docs)["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=a", "--namespace=b"]
    assert "--all-namespaces" not in args


# --- PodDisruptionBudget ---------------------------------------------------------------------

@pytest.mark.parametrize("sets", [
    ["podDisruptionBudget.enabled=true"],
    ["podDisruptionBudget.enabled=true", "podDisruptionBudget.maxUnavailable=10%"],
    ["podDisruptionBudget.enabled=true", "replicaCount=3", "peering.enabled=true"],
], ids=["one-replica", "percent", "three-replicas"])
def test_pdb_never_blocks_a_drain(sets: list[str]) -> None:
    spec = one(render(sets=sets), "PodDisruptionBudget")["spec"]
    assert "minAvailable" not in spec
    budget = spec["maxUnavailable"]
    assert (budget >= 1) if isinstance(budget, int) else int(budget.rstrip("%")) >= 1


@pytest.mark.parametrize("bad", ["podDisruptionBudget.maxUnavailable=0",
                                 "podDisruptionBudget.maxUnavailable=0%",
                                 "podDisruptionBudget.minAvailable=1"])
def test_schema_refuses_a_blocking_pdb(bad: str) -> None:
    render_error(sets=["podDisruptionBudget.enabled=true", bad])


def test_pdb_is_optional() -> None:
    assert not of_kind(render(), "PodDisruptionBudget")


# --- RBAC ----------------------------------------------------------------------------------

WATCHED = ["team-a", "team-b"]
NAMESPACED = [f"operator.watchNamespaces.{ns}=true" for ns in WATCHED] + [
    "operator.watchNamespaces.team-c=false"]
# (sets, mode, peering): every combination the chart's RBAC depends on.
MODES = {
    "cluster-wide-standalone": ([], "cluster-wide", False),
    "cluster-wide-peering": (["peering.enabled=true"], "cluster-wide", True),
    "namespaced-standalone": (NAMESPACED, "namespaced", False),
    "namespaced-peering": ([*NAMESPACED, "peering.enabled=true"], "namespaced", True),
}
NAMESPACED_RESOURCES = {"pods", "services", "networkpolicies"}


def _granted(docs: list[Manifest], kind: str | None = None) -> set[tuple[str, str, str]]:
    kinds = (kind,) if kind else ("ClusterRole", "Role")
    return rule_triples(r for k in kinds for role in of_kind(docs, k) for r in role["rules"])


def _ci_mode(values: Path) -> tuple[str, bool]:
    import yaml
    data = yaml.safe_load(values.read_text()) or {}
    watched = any(data.get("operator", {}).get("watchNamespaces", {}).values())
    return ("namespaced" if watched else "cluster-wide",
            bool(data.get("peering", {}).get("enabled")))


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_rbac_is_exactly_the_operators_rules(values: Path) -> None:
    mode, peering = _ci_mode(values)
    granted, wanted = _granted(render(values=[values])), operator_rules(mode, peering=peering)
    assert granted == wanted, (f"chart grants more: {sorted(granted - wanted)}; "
                               f"chart lacks: {sorted(wanted - granted)}")


@pytest.mark.parametrize("case", MODES)
def test_each_mode_grants_exactly_its_rules_where_they_belong(case: str) -> None:
    sets, mode, peering = MODES[case]
    docs = render(sets=sets)
    granted, wanted = _granted(docs), operator_rules(mode, peering=peering)
    assert granted == wanted, (f"chart grants more: {sorted(granted - wanted)}; "
                               f"chart lacks: {sorted(wanted - granted)}")
    cluster_rules = operator_rules(mode, peering=peering, cluster_scoped=True)
    namespaced_rules = operator_rules(mode, peering=peering, cluster_scoped=False)
    assert {r for _, r, _ in namespaced_rules} >= NAMESPACED_RESOURCES
    sa = {"kind": "ServiceAccount", "name": "elastrain", "namespace": "elastrain-system"}
    roles = {r["metadata"]["name"]: r for r in of_kind(docs, "ClusterRole")}
    cluster_bindings = of_kind(docs, "ClusterRoleBinding")
    for binding in cluster_bindings:
        assert binding["roleRef"]["kind"] == "ClusterRole" and binding["subjects"] == [sa]
    assert {b["roleRef"]["name"] for b in cluster_bindings} == set(roles)
    if mode == "cluster-wide":
        assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding")
        return
    # Namespaced: no ClusterRole may touch a namespaced object (no cluster-wide pod create) ...
    assert _granted(docs, "ClusterRole") == cluster_rules
    assert not [t for t in _granted(docs, "ClusterRole") if t[1] in NAMESPACED_RESOURCES]
    # ... and each watched namespace, and only those, has one Role with exactly the namespaced
    # rules, bound to the operator's ServiceAccount by one RoleBinding.
    by_namespace: dict[str, list[Manifest]] = {}
    for doc in of_kind(docs, "Role") + of_kind(docs, "RoleBinding"):
        by_namespace.setdefault(doc["metadata"]["namespace"], []).append(doc)
    assert sorted(by_namespace) == WATCHED
    for ns, objects in by_namespace.items():
        (role,) = of_kind(objects, "Role")
        (binding,) = of_kind(objects, "RoleBinding")
        assert rule_triples(role["rules"]) == namespaced_rules, ns
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [sa]


def test_notices_off_grants_nothing_on_nodes_and_tells_the_operator() -> None:
    docs = render(sets=["notices.enabled=false", "notices.taints.example\\.com/x=true"])
    assert _granted(docs) == operator_rules("cluster-wide", peering=False, notices=False)
    assert not [t for t in _granted(docs) if t[1] == "nodes"]
    env = _operator_env(docs)
    assert env["ELASTRAIN_NODE_NOTICES"] == "false"
    on = _operator_env(render(sets=["notices.taints.example\\.com/x=true",
                                    "notices.taints.other/y=false"]))
    assert (on["ELASTRAIN_NODE_NOTICES"], on["ELASTRAIN_NOTICE_TAINTS"]) == ("true",
                                                                             "example.com/x")
    assert "ELASTRAIN_NOTICE_TAINTS" not in _operator_env(render())  # the operator's default


def _operator_env(docs: list[Manifest]) -> dict[str, str]:
    (deployment,) = of_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_rules_are_marked_cluster_scoped_exactly_for_cluster_scoped_resources() -> None:
    from elastrain_operator.rbac import RULES
    cluster_scoped = {"namespaces", "customresourcedefinitions", "clusterkopfpeerings",
                      "nodes", "resourceflavors", "workloadpriorityclasses", "priorityclasses",
                      "clusterqueues"}
    for rule in RULES:
        assert all((r in cluster_scoped) == rule.cluster_scoped for r in rule.resources), rule


def test_rbac_has_no_wildcards_and_never_reads_or_changes_secrets(
        ci_render: list[Manifest]) -> None:
    for group, resource, verb in _granted(ci_render):
        assert "*" not in (group, resource, verb)
        assert resource not in {"clusterroles", "clusterrolebindings"}
        assert resource != "nodes" or verb in {"list", "watch"}  # notices: read only
        assert resource != "secrets" or verb == "create"  # each job's control Secret only
        assert verb not in {"escalate", "bind", "impersonate"}
    assert ("elastrain.dev", "trainingjobs/status", "patch") in _granted(ci_render)


def test_rbac_can_be_left_to_the_cluster_admin() -> None:
    docs = render(sets=["rbac.create=false"])
    assert not [d for d in docs if _group(d) == "rbac.authorization.k8s.io"]


# --- NetworkPolicy configuration handed to the operator -------------------------------------

def _env(docs: list[Manifest]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container(docs)["env"] if "value" in e}


def test_network_policy_is_on_by_default_and_can_be_turned_off() -> None:
    assert _env(render())["ELASTRAIN_NETWORK_POLICY"] == "true"
    off = _env(render(sets=["networkPolicy.enabled=false"]))
    assert off["ELASTRAIN_NETWORK_POLICY"] == "false"


def test_operator_peer_selects_the_operator_pods_in_the_release_namespace() -> None:
    import json
    docs = render(release="ops", namespace="platform")
    peer = json.loads(_env(docs)["ELASTRAIN_NETWORK_POLICY_OPERATOR_PEER"])
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "platform"}}
    deployment = one(docs, "Deployment")["spec"]
    assert peer["podSelector"] == {"matchLabels": deployment["selector"]["matchLabels"]}
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "ops"
    assert peer["podSelector"]["matchLabels"].items() <= (
        deployment["template"]["metadata"]["labels"].items())
    assert set(peer) == {"namespaceSelector", "podSelector"}


def test_scrapers_reach_the_operator_as_a_list_of_peers_in_name_order() -> None:
    import json
    assert json.loads(_env(render())["ELASTRAIN_NETWORK_POLICY_SCRAPERS"]) == []
    docs = render(sets=[
        "networkPolicy.scrapers.prometheus.podSelector.matchLabels.app=prometheus",
        "networkPolicy.scrapers.prometheus.namespaceSelector.matchLabels.team=obs",
        "networkPolicy.scrapers.agent.ipBlock.cidr=10.0.0.0/24",
        "networkPolicy.scrapers.dropped=null"])
    assert json.loads(_env(docs)["ELASTRAIN_NETWORK_POLICY_SCRAPERS"]) == [
        {"ipBlock": {"cidr": "10.0.0.0/24"}},
        {"namespaceSelector": {"matchLabels": {"team": "obs"}},
         "podSelector": {"matchLabels": {"app": "prometheus"}}}]


@pytest.mark.parametrize("bad", [
    "networkPolicy.scrapers.p.podSelectr.matchLabels.app=x",
    "networkPolicy.scrapers.p.ipBlock.cidr=10.0.0.0/8,"
    "networkPolicy.scrapers.p.podSelector.matchLabels.app=x",
    "networkPolicy.scrapers.p.podSelector.matchExpressions[0].key=app,"
    "networkPolicy.scrapers.p.podSelector.matchExpressions[0].operator=Like",
    "networkPolicy.enabled=maybe",
])
def test_schema_refuses_a_malformed_network_policy_value(bad: str) -> None:
    render_error(sets=[bad])


# --- ServiceAccount -------------------------------------------------------------------------

def test_service_account_carries_cloud_identity_annotations() -> None:
    docs = render(sets=["serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn=arn:x",
                        "serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account=g@p"])
    sa = one(docs, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:x",
                                             "iam.gke.io/gcp-service-account": "g@p"}
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]


def test_existing_service_account_is_used_when_not_created() -> None:
    docs = render(sets=["serviceAccount.create=false", "serviceAccount.name=ops"])
    assert not of_kind(docs, "ServiceAccount")
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    for binding in of_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"][0]["name"] == "ops"


# --- monitoring ---------------------------------------------------------------------------

def test_service_monitor_scrapes_the_operator_metrics_port() -> None:
    docs = render(sets=["metrics.serviceMonitor.enabled=true",
                        "metrics.serviceMonitor.additionalLabels.release=kps"])
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    container_ports = {p["name"]: p["containerPort"] for p in _container(docs)["ports"]}
    assert container_ports[port["targetPort"]] == port["port"]
    assert any(a == f"--metrics-port={port['port']}" for a in _container(docs)["args"])
    # The Service selects the operator pods and nothing else.
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_monitors_are_opt_in() -> None:
    docs = render()
    assert not of_kind(docs, "ServiceMonitor") and not of_kind(docs, "PodMonitor")


def test_pod_monitor_selects_the_operators_worker_pods() -> None:
    from elastrain_operator.model.spec import TrainingJob
    from elastrain_operator.render.workers import render_worker_pod

    docs = render(sets=["metrics.trainerPodMonitor.enabled=true",
                        "metrics.trainerPodMonitor.additionalLabels.release=kps"])
    monitor = one(docs, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    job = TrainingJob.model_validate({
        "metadata": {"name": "demo", "namespace": "ml", "uid": "u"},
        "spec": {"image": "trainer:dev"}})
    worker = render_worker_pod(job, 0, 0)
    labels = worker["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    port_names = {p["name"] for c in worker["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["port"] in port_names
    for label in monitor["spec"]["podTargetLabels"]:
        assert label in labels
    # A store pod is not a trainer: it must not be scraped as one.
    from elastrain_operator.render.rendezvous import render_store_pod
    store = render_store_pod(job)
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= (
        store["metadata"]["labels"].items())


def test_pod_monitor_follows_watched_namespaces() -> None:
    docs = render(sets=["metrics.trainerPodMonitor.enabled=true",
                        "operator.watchNamespaces.ml=true"])
    assert one(docs, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar() -> None:
    import json
    docs = render(sets=["grafana.dashboards.enabled=true"])
    cm = one(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["elastrain.json"])
    assert dashboard["panels"]
    assert json.loads((CHART / "files" / "dashboards" / "elastrain.json").read_text()) == dashboard


# --- the control key (elastrain_operator/control.py) ----------------------------------------

def _control_key_ref(docs: list[Manifest]) -> Manifest:
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in _container(docs)["env"]
              if e["name"] == "ELASTRAIN_CONTROL_KEY"]
    return dict(ref)


def test_the_operator_gets_a_control_key_the_chart_keeps() -> None:
    import base64
    docs = render(release="ops", namespace="platform")
    secret = one(docs, "Secret")
    assert secret["metadata"]["namespace"] == "platform"
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert len(key) == 64 and key.isalnum()
    assert _control_key_ref(docs) == {"name": secret["metadata"]["name"], "key": "key"}
    # Offline (no cluster to look the Secret up in) each render makes a new key: the reason
    # for control.existingSecret.
    assert base64.b64decode(one(render(release="ops", namespace="platform"), "Secret")[
        "data"]["key"]).decode() != key


def test_an_existing_secret_holds_the_control_key_instead() -> None:
    docs = render(sets=["control.existingSecret=my-key"])
    assert not of_kind(docs, "Secret")
    assert _control_key_ref(docs) == {"name": "my-key", "key": "key"}


def test_the_operator_leaves_a_lost_node_after_30_seconds_unless_told_otherwise() -> None:
    """Kubernetes gives a pod 300 s on an unreachable or NotReady node; the operator's pod
    tolerates 30 s, then its Deployment starts it on a live node. Each can be dropped."""
    def tolerations(*sets: str) -> dict[str, Manifest]:
        pod = one(render(sets=list(sets)), "Deployment")["spec"]["template"]["spec"]
        return {t["key"]: t for t in pod.get("tolerations", [])}

    default = tolerations()
    for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"):
        assert default[key] == {"key": key, "operator": "Exists", "effect": "NoExecute",
                                "tolerationSeconds": 30}
    assert set(tolerations("tolerations.nodeNotReady=null")) == {
        "node.kubernetes.io/unreachable"}
