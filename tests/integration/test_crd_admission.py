"""The TrainingJob CRD on a real kube-apiserver: bad specs are refused naming the field, good ones
are stored with defaults, and kubectl's columns and scale subresource work."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.integration.conftest import kubectl
from tests.unit.operator.builders import make_job_manifest

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "elastrain.dev", "v1alpha1", "trainingjobs"

Mutation = Callable[[dict[str, Any]], None]


def set_path(path: str, value: Any) -> Mutation:
    """A mutation that sets spec.<path> (dotted, list indices as [n]) to value."""
    def mutate(manifest: dict[str, Any]) -> None:
        node: Any = manifest["spec"]
        keys = path.replace("[", ".[").split(".")
        for key in keys[:-1]:
            node = node[int(key[1:-1])] if key.startswith("[") else node.setdefault(key, {})
        node[keys[-1]] = value
    return mutate


def drop(path: str) -> Mutation:
    def mutate(manifest: dict[str, Any]) -> None:
        del manifest["spec"][path]
    return mutate


def both(*mutations: Mutation) -> Mutation:
    def mutate(manifest: dict[str, Any]) -> None:
        for m in mutations:
            m(manifest)
    return mutate


S3 = {"uri": "s3://bucket/run"}

# (id, mutation, the field path the apiserver's message must name)
INVALID: list[tuple[str, Mutation, str]] = [
    ("no-image", drop("image"), "spec.image"),
    ("empty-image", set_path("image", ""), "spec.image"),
    ("long-image", set_path("image", "x" * 600), "spec.image"),
    ("zero-replicas", set_path("replicas", 0), "spec.replicas"),
    ("replicas-above-max", set_path("replicas", 5), "spec.replicas"),
    ("replicas-below-min", both(set_path("minReplicas", 3), set_path("replicas", 2)),
     "spec.replicas"),
    ("zero-min", set_path("minReplicas", 0), "spec.minReplicas"),
    ("min-above-max", both(set_path("minReplicas", 4), set_path("maxReplicas", 3),
                           set_path("replicas", 3)), "spec.minReplicas"),
    ("max-too-large", set_path("maxReplicas", 5000), "spec.maxReplicas"),
    ("replicas-string", set_path("replicas", "two"), "spec.replicas"),
    ("nproc-word", set_path("nprocPerNode", "all"), "spec.nprocPerNode"),
    ("nproc-zero", set_path("nprocPerNode", 0), "spec.nprocPerNode"),
    ("nproc-huge", set_path("nprocPerNode", 65), "spec.nprocPerNode"),
    ("strategy", set_path("strategy", "zero3"), "spec.strategy"),
    ("model", set_path("trainer.model", "gpt-7b"), "spec.trainer.model"),
    ("precision", set_path("trainer.precision", "int8"), "spec.trainer.precision"),
    ("steps-zero", set_path("trainer.steps", 0), "spec.trainer.steps"),
    ("lr-zero", set_path("trainer.lr", 0), "spec.trainer.lr"),
    ("min-lr-above-lr", both(set_path("trainer.lr", 1e-4), set_path("trainer.minLr", 1e-3)),
     "spec.trainer.minLr"),
    ("batch-not-multiple", both(set_path("trainer.globalBatchSize", 10),
                                set_path("trainer.microBatchSize", 4)),
     "spec.trainer.globalBatchSize"),
    ("offload-with-ddp", set_path("trainer.cpuOffload", True), "spec.trainer.cpuOffload"),
    ("schedule", set_path("trainer.lrSchedule", "linear"), "spec.trainer.lrSchedule"),
    ("decay-fraction", set_path("trainer.decayFraction", 1.5), "spec.trainer.decayFraction"),
    ("seq-len-tiny", set_path("trainer.seqLen", 2), "spec.trainer.seqLen"),
    ("uri-scheme", set_path("checkpoint", {"uri": "gs://bucket/run"}), "spec.checkpoint.uri"),
    ("uri-no-bucket", set_path("checkpoint", {"uri": "s3:///run"}), "spec.checkpoint.uri"),
    ("uri-missing", set_path("checkpoint", {"keep": 2}), "spec.checkpoint.uri"),
    ("endpoint-scheme", set_path("checkpoint", {**S3, "endpoint": "minio:9000"}),
     "spec.checkpoint.endpoint"),
    ("keep-zero", set_path("checkpoint", {**S3, "keep": 0}), "spec.checkpoint.keep"),
    ("interval-negative", set_path("checkpoint", {**S3, "intervalSeconds": -1}),
     "spec.checkpoint.intervalSeconds"),
    ("secret-name", set_path("checkpoint", {**S3, "credentialsSecret": {"name": "Bad_Name"}}),
     "spec.checkpoint.credentialsSecret.name"),
    ("rdzv-port", set_path("rendezvous.port", 80), "spec.rendezvous.port"),
    ("rdzv-join-timeout", set_path("rendezvous.joinTimeoutSeconds", 0),
     "spec.rendezvous.joinTimeoutSeconds"),
    ("max-restarts-negative", set_path("restartPolicy.maxRestarts", -1),
     "spec.restartPolicy.maxRestarts"),
    ("backoff-huge", set_path("restartPolicy.backoffSeconds", 99999),
     "spec.restartPolicy.backoffSeconds"),
    ("grace-huge", set_path("terminationGracePeriodSeconds", 99999),
     "spec.terminationGracePeriodSeconds"),
    ("deadline-zero", set_path("activeDeadlineSeconds", 0), "spec.activeDeadlineSeconds"),
    ("ttl-negative", set_path("ttlSecondsAfterFinished", -5), "spec.ttlSecondsAfterFinished"),
    ("toleration-operator", set_path("template", {"tolerations": [{"operator": "Maybe"}]}),
     "spec.template.tolerations[0].operator"),
    ("service-account", set_path("template", {"serviceAccountName": "UPPER"}),
     "spec.template.serviceAccountName"),
    ("cpu-quantity", set_path("resources", {"limits": {"cpu": "lots"}}),
     "spec.resources.limits.cpu"),
    ("empty-command", set_path("command", []), "spec.command"),
    ("env-without-name", set_path("env", [{"value": "x"}]), "spec.env[0].name"),
    ("too-many-args", set_path("args", ["a"] * 300), "spec.args"),
    ("suspend-string", set_path("suspend", "yes"), "spec.suspend"),
    ("metrics-port", set_path("metricsPort", 70000), "spec.metricsPort"),
]


@pytest.fixture(scope="module")
def api(crd: Any) -> Iterator[client.CustomObjectsApi]:
    api_client = config.new_client_from_config(config_file=str(crd.kubeconfig))
    yield client.CustomObjectsApi(api_client)
    api_client.close()


def create(api: client.CustomObjectsApi, namespace: str, manifest: dict[str, Any]) -> Any:
    return api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest,
                                               field_validation="Strict")


def rejection(call: Callable[[], Any], status: int = 422) -> str:
    with pytest.raises(ApiException) as err:
        call()
    assert err.value.status == status, err.value.body
    return str(json.loads(err.value.body)["message"])


def test_table_has_at_least_30_distinct_mistakes() -> None:
    assert len(INVALID) >= 30
    assert len({case[0] for case in INVALID}) == len(INVALID)


@pytest.mark.parametrize(("mutation", "field"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_spec_is_rejected_naming_the_field(
        api: client.CustomObjectsApi, kube_namespace: str, mutation: Mutation,
        field: str) -> None:
    manifest = make_job_manifest("bad")
    mutation(manifest)
    message = rejection(lambda: create(api, kube_namespace, manifest))
    assert field in message, message


def test_unknown_field_is_rejected(api: client.CustomObjectsApi, kube_namespace: str) -> None:
    manifest = make_job_manifest("typo", trainr={"steps": 5})
    # Strict field validation answers 400 (a decoding error), as `kubectl apply` shows it.
    message = rejection(lambda: create(api, kube_namespace, manifest), status=400)
    assert 'unknown field "spec.trainr"' in message, message


def test_minimal_job_gets_defaults(api: client.CustomObjectsApi, kube_namespace: str) -> None:
    manifest = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
                "metadata": {"name": "minimal"}, "spec": {"image": "trainer:dev"}}
    stored = create(api, kube_namespace, manifest)["spec"]
    assert stored["replicas"] == 1 and stored["minReplicas"] == 1
    assert "maxReplicas" not in stored
    assert stored["strategy"] == "ddp" and stored["nprocPerNode"] == 1
    assert stored["trainer"]["model"] == "gpt-tiny"
    assert stored["trainer"]["globalBatchSize"] == 8
    assert stored["rendezvous"]["port"] == 29400
    assert stored["rendezvous"]["store"] == {}
    assert stored["restartPolicy"] == {"maxRestarts": 3, "backoffSeconds": 10,
                                       "maxBackoffSeconds": 300}
    assert stored["terminationGracePeriodSeconds"] == 120 and stored["suspend"] is False


def test_full_job_is_accepted(api: client.CustomObjectsApi, kube_namespace: str) -> None:
    manifest = make_job_manifest(
        "full", replicas=4, minReplicas=2, maxReplicas=8, nprocPerNode="auto", strategy="fsdp",
        command=["torchrun"], args=["-m", "elastrain_trainer"],
        env=[{"name": "A", "value": "1"},
             {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        resources={"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 8}},
        trainer={"model": "gpt-100m", "precision": "bf16", "cpuOffload": True,
                 "activationCheckpointing": True, "lrSchedule": "wsd", "globalBatchSize": 64,
                 "microBatchSize": 4, "spikeFactor": 3.0},
        checkpoint={"uri": "s3://ckpts/run-1", "endpoint": "http://minio:9000",
                    "credentialsSecret": {"name": "s3-creds"}, "intervalSteps": 100,
                    "keep": 5, "async": True},
        rendezvous={"joinTimeoutSeconds": 900, "store": {"nodeSelector": {"pool": "on-demand"}}},
        restartPolicy={"maxRestarts": 5, "maxPreemptions": 100},
        template={"nodeSelector": {"pool": "spot"}, "priorityClassName": "batch",
                  "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                  "affinity": {"nodeAffinity": {}}, "volumes": [{"name": "d", "emptyDir": {}}],
                  "labels": {"team": "ml"}},
        ttlSecondsAfterFinished=3600, activeDeadlineSeconds=86400, suspend=True)
    stored = create(api, kube_namespace, manifest)["spec"]
    assert stored["nprocPerNode"] == "auto"
    assert stored["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert stored["env"][1]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert stored["template"]["affinity"] == {"nodeAffinity": {}}
    assert stored["checkpoint"]["intervalSeconds"] == 600  # default inside a given block


@pytest.mark.parametrize(("patch", "field"), [
    ({"strategy": "fsdp"}, "spec.strategy"),
    ({"checkpoint": {"uri": "s3://bucket/other"}}, "spec.checkpoint.uri"),
    ({"trainer": {"model": "gpt-small"}}, "spec.trainer.model"),
    ({"maxReplicas": 8}, "spec.maxReplicas"),
    ({"rendezvous": {"port": 29500}}, "spec.rendezvous"),
])
def test_immutable_fields(api: client.CustomObjectsApi, kube_namespace: str,
                          patch: dict[str, Any], field: str) -> None:
    create(api, kube_namespace, make_job_manifest("imm", checkpoint=S3))
    message = rejection(lambda: api.patch_namespaced_custom_object(
        GROUP, VERSION, kube_namespace, PLURAL, "imm", {"spec": patch}))
    assert field in message and "immutable" in message, message


def test_kubectl_columns_and_scale(api: client.CustomObjectsApi, crd: Any,
                                   kube_namespace: str) -> None:
    create(api, kube_namespace, make_job_manifest("cols"))
    api.patch_namespaced_custom_object_status(GROUP, VERSION, kube_namespace, PLURAL, "cols", {
        "status": {"phase": "Running", "workers": "2/2", "replicas": 2, "readyReplicas": 2,
                   "selector": "elastrain.dev/job-name=cols", "restarts": 1, "preemptions": 3,
                   "progress": {"step": 42, "totalSteps": 100, "loss": 2.5},
                   "lastCheckpoint": {"step": 40, "uri": "s3://b/p/step-40"}}})

    out = kubectl(crd, "get", "tj", "cols", "-n", kube_namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "WORKERS", "STEP", "LAST", "CHECKPOINT",
                              "RESTARTS", "PREEMPTIONS", "AGE"]
    assert out[1].split()[:7] == ["cols", "Running", "2/2", "42", "40", "1", "3"]
    wide = kubectl(crd, "get", "tj", "cols", "-n", kube_namespace, "-o", "wide").stdout
    assert "STRATEGY" in wide and "2.5" in wide
    assert "cols" in kubectl(crd, "get", "elastrain", "-n", kube_namespace).stdout

    kubectl(crd, "scale", "tj/cols", "-n", kube_namespace, "--replicas=3")
    obj = api.get_namespaced_custom_object(GROUP, VERSION, kube_namespace, PLURAL, "cols")
    assert obj["spec"]["replicas"] == 3
    scale = api.get_namespaced_custom_object_scale(GROUP, VERSION, kube_namespace, PLURAL, "cols")
    assert scale["status"]["selector"] == "elastrain.dev/job-name=cols"
    assert scale["status"]["replicas"] == 2

    refused = kubectl(crd, "scale", "tj/cols", "-n", kube_namespace, "--replicas=9", check=False)
    assert refused.returncode != 0
    assert "spec.replicas must be <= spec.maxReplicas" in refused.stderr, refused.stderr
