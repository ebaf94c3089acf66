"""The TrainingJob CRD on a real kube-apiserver: bad specs are refused naming the field, good ones
are stored with defaults, and kubectl's columns and scale subresource work."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from elastrain_operator.model.pod import RESERVED_VOLUMES_MESSAGE
from elastrain_operator.model.spec import (
    DEFAULT_MODE_CHANGE_MESSAGE,
    INPROCESS_COMMAND_MESSAGE,
    MAX_WORKERS,
    NCCL_ERROR_HANDLING_MESSAGE,
    SPARES_BOUND_MESSAGE,
    SPARES_METRICS_MESSAGE,
    SPARES_MODE_MESSAGE,
)
from elastrain_operator.model.trainer import (
    BATCH_MESSAGE,
    BYTE_VOCAB_MESSAGE,
    DATASET_MESSAGE,
    VALIDATION_DATASET_MESSAGE,
)
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


def rename(name: str) -> Mutation:
    def mutate(manifest: dict[str, Any]) -> None:
        manifest["metadata"]["name"] = name
    return mutate


def both(*mutations: Mutation) -> Mutation:
    def mutate(manifest: dict[str, Any]) -> None:
        for m in mutations:
            m(manifest)
    return mutate


S3 = {"uri": "s3://bucket/run"}
Cause = tuple[str, str]  # (field, message) of one entry of the 422's details.causes


def rule(field: str, message: str, kind: str = "object") -> Cause:
    """A CEL rule's refusal: the apiserver prefixes the rule's message with the value's type."""
    return field, f'Invalid value: "{kind}": {message}'


def bound(field: str, value: Any, should: str) -> Cause:
    """An OpenAPI bound's refusal (minimum, maximum, pattern, minLength...)."""
    return field, f"Invalid value: {json.dumps(value)}: {field} in body should {should}"


def unsupported(field: str, value: str, *supported: str) -> Cause:
    listed = ", ".join(f'"{s}"' for s in supported)
    return field, f'Unsupported value: "{value}": supported values: {listed}'


def required(field: str) -> Cause:
    return field, "Required value"


NPROC = 'spec.nprocPerNode must be an integer in [1, 64] or "auto"'
NPROC_AUTO = ('spec.nprocPerNode "auto" needs a GPU in spec.resources (e.g. limits '
              'nvidia.com/gpu); set an integer for CPU workers')
NAME_LENGTH = ("metadata.name must be at most 51 characters: worker hostnames are "
               "<name>-worker-<index> (at most 63)")
NAME_LABEL = ("metadata.name must start with a letter and contain no dots: "
              "it names the job's Services")
URI = ("spec.checkpoint.uri must be s3://<bucket>[/<prefix>], gs://<bucket>[/<prefix>] (the image "
       "needs gcsfs), az://<container>[/<prefix>] or abfs://<container>[/<prefix>] (the image "
       "needs adlfs), or file://<path>")
DNS_LABEL = "match '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"
QUANTITY = ("match '^(\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
            "([eE](\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))))?$'")

# (id, mutation, every cause the apiserver must answer with: the exact field and message)
INVALID: list[tuple[str, Mutation, list[Cause]]] = [
    ("no-image", drop("image"), [required("spec.image")]),
    ("empty-image", set_path("image", ""),
     [bound("spec.image", "", "be at least 1 chars long")]),
    ("long-image", set_path("image", "x" * 600),
     [("spec.image", "Too long: may not be more than 512 bytes")]),
    ("zero-replicas", set_path("replicas", 0),
     [bound("spec.replicas", 0, "be greater than or equal to 1"),
      rule("spec.replicas", "spec.replicas must be >= spec.minReplicas")]),
    ("replicas-above-max", set_path("replicas", 5),
     [rule("spec.replicas", "spec.replicas must be <= spec.maxReplicas")]),
    ("replicas-below-min", both(set_path("minReplicas", 3), set_path("replicas", 2)),
     [rule("spec.replicas", "spec.replicas must be >= spec.minReplicas")]),
    ("zero-min", set_path("minReplicas", 0),
     [bound("spec.minReplicas", 0, "be greater than or equal to 1")]),
    ("min-above-max", both(set_path("minReplicas", 4), set_path("maxReplicas", 3),
                           set_path("replicas", 3)),
     [rule("spec.replicas", "spec.replicas must be >= spec.minReplicas"),
      rule("spec.minReplicas", "spec.minReplicas must be <= spec.maxReplicas")]),
    ("max-too-large", set_path("maxReplicas", 5000),
     [bound("spec.maxReplicas", 5000, "be less than or equal to 1024")]),
    ("replicas-string", set_path("replicas", "two"),
     [("spec.replicas",
       'Invalid value: "string": spec.replicas in body must be of type integer: "string"'),
      (".spec.replicas", "Invalid value: 0: .spec.replicas accessor error: two is of the type "
                         "string, expected int64")]),
    ("nproc-word", set_path("nprocPerNode", "all"), [rule("spec.nprocPerNode", NPROC, "")]),
    ("nproc-zero", set_path("nprocPerNode", 0), [rule("spec.nprocPerNode", NPROC, "")]),
    ("nproc-huge", set_path("nprocPerNode", 65), [rule("spec.nprocPerNode", NPROC, "")]),
    ("nproc-auto-without-gpu", both(set_path("nprocPerNode", "auto"),
                                    set_path("resources", {"limits": {"cpu": 4}})),
     [rule("spec.nprocPerNode", NPROC_AUTO)]),
    ("name-too-long", rename("a" * 52), [rule("metadata.name", NAME_LENGTH)]),
    ("name-starts-with-digit", rename("9lives"), [rule("metadata.name", NAME_LABEL)]),
    ("name-with-dot", rename("gpt.small"), [rule("metadata.name", NAME_LABEL)]),
    ("strategy", set_path("strategy", "zero3"),
     [unsupported("spec.strategy", "zero3", "ddp", "fsdp", "hsdp")]),
    ("model", set_path("trainer.model", "gpt-7b"),
     [unsupported("spec.trainer.model", "gpt-7b", "gpt-tiny", "gpt-small", "gpt-100m",
                  "gpt-350m", "gpt-1b")]),
    ("precision", set_path("trainer.precision", "int8"),
     [unsupported("spec.trainer.precision", "int8", "bf16", "fp16", "fp32")]),
    ("steps-zero", set_path("trainer.steps", 0),
     [bound("spec.trainer.steps", 0, "be greater than or equal to 1")]),
    ("lr-zero", set_path("trainer.lr", 0),
     [bound("spec.trainer.lr", 0, "be greater than 0"),
      rule("spec.trainer.minLr", "spec.trainer.minLr must be <= spec.trainer.lr")]),
    ("min-lr-above-lr", both(set_path("trainer.lr", 1e-4), set_path("trainer.minLr", 1e-3)),
     [rule("spec.trainer.minLr", "spec.trainer.minLr must be <= spec.trainer.lr")]),
    ("batch-not-multiple", both(set_path("trainer.globalBatchSize", 10),
                                set_path("trainer.microBatchSize", 4)),
     [rule("spec.trainer.globalBatchSize", BATCH_MESSAGE)]),
    # Unset fields are the built-in trainer's 8 and 2: 9 alone is refused, 12 alone is not.
    ("batch-global-alone", set_path("trainer.globalBatchSize", 9),
     [rule("spec.trainer.globalBatchSize", BATCH_MESSAGE)]),
    ("batch-micro-alone", set_path("trainer.microBatchSize", 3),
     [rule("spec.trainer.globalBatchSize", BATCH_MESSAGE)]),
    ("offload-with-ddp", set_path("trainer.cpuOffload", True),
     [rule("spec.trainer.cpuOffload", "spec.trainer.cpuOffload requires spec.strategy fsdp")]),
    ("schedule", set_path("trainer.lrSchedule", "linear"),
     [unsupported("spec.trainer.lrSchedule", "linear", "cosine", "wsd")]),
    ("decay-fraction", set_path("trainer.decayFraction", 1.5),
     [bound("spec.trainer.decayFraction", 1.5, "be less than or equal to 1")]),
    ("seq-len-tiny", set_path("trainer.seqLen", 2),
     [bound("spec.trainer.seqLen", 2, "be greater than or equal to 8")]),
    ("dataset-scheme", set_path("trainer.dataset", "gs://corpus/train.bin"),
     [rule("spec.trainer.dataset", DATASET_MESSAGE, "string")]),
    ("dataset-no-key", set_path("trainer.dataset", "s3://corpus"),
     [rule("spec.trainer.dataset", DATASET_MESSAGE, "string")]),
    ("dataset-list-with-builtin", set_path("trainer.dataset", "s3://corpus/a_*.bin,text"),
     [rule("spec.trainer.dataset", DATASET_MESSAGE, "string")]),
    ("validation-dataset-builtin", set_path("trainer.validation", {"dataset": "text"}),
     [rule("spec.trainer.validation.dataset", VALIDATION_DATASET_MESSAGE, "string")]),
    ("validation-interval-zero", set_path("trainer.validation", {
        "dataset": "s3://corpus/val_*.bin", "intervalSteps": 0}),
     [bound("spec.trainer.validation.intervalSteps", 0, "be greater than or equal to 1")]),
    ("validation-batches-zero", set_path("trainer.validation", {
        "dataset": "file:///data/val.bin", "batches": 0}),
     [bound("spec.trainer.validation.batches", 0, "be greater than or equal to 1")]),
    ("dataset-format", set_path("trainer.datasetFormat", "parquet"),
     [unsupported("spec.trainer.datasetFormat", "parquet", "nanogpt", "llmc")]),
    ("vocab-size-one", both(set_path("trainer.dataset", "s3://corpus/train.bin"),
                            set_path("trainer.vocabSize", 1)),
     [bound("spec.trainer.vocabSize", 1, "be greater than or equal to 2")]),
    ("byte-dataset-small-vocab", set_path("trainer.vocabSize", 100),
     [rule("spec.trainer.vocabSize", BYTE_VOCAB_MESSAGE)]),
    ("uri-scheme", set_path("checkpoint", {"uri": "ftp://bucket/run"}),
     [rule("spec.checkpoint.uri", URI, "string")]),
    ("uri-gs-bucket", set_path("checkpoint", {"uri": "gs://My-Bucket/run"}),
     [rule("spec.checkpoint.uri", URI, "string")]),
    ("uri-az-container", set_path("checkpoint", {"uri": "az://my_container/run"}),
     [rule("spec.checkpoint.uri", URI, "string")]),
    ("uri-no-bucket", set_path("checkpoint", {"uri": "s3:///run"}),
     [rule("spec.checkpoint.uri", URI, "string")]),
    ("uri-missing", set_path("checkpoint", {"keep": 2}), [required("spec.checkpoint.uri")]),
    ("endpoint-scheme", set_path("checkpoint", {**S3, "endpoint": "minio:9000"}),
     [rule("spec.checkpoint.endpoint",
           "spec.checkpoint.endpoint must be an http:// or https:// URL", "string")]),
    ("resume-unknown", set_path("checkpoint", {**S3, "resume": "Always"}),
     [unsupported("spec.checkpoint.resume", "Always", "Latest", "Never")]),
    ("keep-zero", set_path("checkpoint", {**S3, "keep": 0}),
     [bound("spec.checkpoint.keep", 0, "be greater than or equal to 1")]),
    ("interval-negative", set_path("checkpoint", {**S3, "intervalSeconds": -1}),
     [bound("spec.checkpoint.intervalSeconds", -1, "be greater than or equal to 0")]),
    ("secret-name", set_path("checkpoint", {**S3, "credentialsSecret": {"name": "Bad_Name"}}),
     [bound("spec.checkpoint.credentialsSecret.name", "Bad_Name", DNS_LABEL)]),
    ("rdzv-port", set_path("rendezvous.port", 80),
     [bound("spec.rendezvous.port", 80, "be greater than or equal to 1024")]),
    ("rdzv-join-timeout", set_path("rendezvous.joinTimeoutSeconds", 0),
     [bound("spec.rendezvous.joinTimeoutSeconds", 0, "be greater than or equal to 1")]),
    ("max-restarts-negative", set_path("restartPolicy.maxRestarts", -1),
     [bound("spec.restartPolicy.maxRestarts", -1, "be greater than or equal to 0")]),
    ("backoff-huge", set_path("restartPolicy.backoffSeconds", 99999),
     [bound("spec.restartPolicy.backoffSeconds", 99999, "be less than or equal to 3600")]),
    ("grace-huge", set_path("terminationGracePeriodSeconds", 99999),
     [bound("spec.terminationGracePeriodSeconds", 99999, "be less than or equal to 3600")]),
    ("deadline-zero", set_path("activeDeadlineSeconds", 0),
     [bound("spec.activeDeadlineSeconds", 0, "be greater than or equal to 1")]),
    ("ttl-negative", set_path("ttlSecondsAfterFinished", -5),
     [bound("spec.ttlSecondsAfterFinished", -5, "be greater than or equal to 0")]),
    ("toleration-operator", set_path("template", {"tolerations": [{"operator": "Maybe"}]}),
     [unsupported("spec.template.tolerations[0].operator", "Maybe", "Exists", "Equal")]),
    ("service-account", set_path("template", {"serviceAccountName": "UPPER"}),
     [bound("spec.template.serviceAccountName", "UPPER", DNS_LABEL)]),
    ("operators-volume-name", set_path("template", {"volumes": [
        {"name": "elastrain-control", "emptyDir": {}}]}),
     [rule("spec.template.volumes", RESERVED_VOLUMES_MESSAGE)]),
    ("cpu-quantity", set_path("resources", {"limits": {"cpu": "lots"}}),
     [bound("spec.resources.limits.cpu", "lots", QUANTITY)]),
    ("empty-command", set_path("command", []),
     [rule("spec.command", "spec.command must not be empty when set")]),
    ("env-without-name", set_path("env", [{"value": "x"}]), [required("spec.env[0].name")]),
    ("too-many-args", set_path("args", ["a"] * 300),
     [("spec.args", "Too many: 300: must have at most 256 items")]),
    ("suspend-string", set_path("suspend", "yes"),
     [("spec.suspend",
       'Invalid value: "string": spec.suspend in body must be of type boolean: "string"')]),
    ("metrics-port", set_path("metricsPort", 70000),
     [bound("spec.metricsPort", 70000, "be less than or equal to 65535")]),
    ("recovery-mode", set_path("recovery", {"mode": "inprocess"}),
     [unsupported("spec.recovery.mode", "inprocess", "Restart", "InProcess")]),
    ("heartbeat-too-short", set_path("recovery", {"mode": "InProcess",
                                                  "heartbeatTimeoutSeconds": 1}),
     [bound("spec.recovery.heartbeatTimeoutSeconds", 1, "be greater than or equal to 2")]),
    ("node-loss-toleration", set_path("recovery", {"nodeLossTolerationSeconds": -1}),
     [bound("spec.recovery.nodeLossTolerationSeconds", -1, "be greater than or equal to 0")]),
    ("inprocess-stock-torchrun", both(set_path("recovery", {"mode": "InProcess"}),
                                      set_path("command", ["torchrun", "train.py"])),
     [rule("spec.recovery.mode", INPROCESS_COMMAND_MESSAGE)]),
    ("inprocess-gpu-error-handling", both(
        set_path("recovery", {"mode": "InProcess"}),
        set_path("resources", {"limits": {"nvidia.com/gpu": 1}}),
        set_path("env", [{"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "3"}])),
     [rule("spec.env", NCCL_ERROR_HANDLING_MESSAGE)]),
    ("spares-negative", both(set_path("recovery", {"mode": "InProcess"}), set_path("spares", -1)),
     [bound("spec.spares", -1, "be greater than or equal to 0")]),
    ("spares-in-restart-mode", both(set_path("recovery", {"mode": "Restart"}),
                                    set_path("spares", 1)),
     [rule("spec.spares", SPARES_MODE_MESSAGE)]),
    # Unset, a stock torchrun script's mode is Restart: spares are refused there too.
    ("spares-stock-torchrun-unset-mode", both(set_path("command", ["torchrun", "train.py"]),
                                              set_path("spares", 1)),
     [rule("spec.spares", SPARES_MODE_MESSAGE)]),
    ("spares-without-metrics", both(set_path("recovery", {"mode": "InProcess"}),
                                    set_path("metricsPort", 0), set_path("spares", 1)),
     [rule("spec.spares", SPARES_METRICS_MESSAGE)]),
    ("spares-past-max-workers", both(set_path("recovery", {"mode": "InProcess"}),
                                     set_path("maxReplicas", MAX_WORKERS),
                                     set_path("spares", 1)),
     [rule("spec.spares", SPARES_BOUND_MESSAGE)]),
    ("spares-past-max-workers-unbounded", both(set_path("recovery", {"mode": "InProcess"}),
                                               drop("maxReplicas"),
                                               set_path("replicas", MAX_WORKERS - 1),
                                               set_path("spares", 2)),
     [rule("spec.spares", SPARES_BOUND_MESSAGE)]),
]
# The apiserver adds this when schema errors kept it from running the CEL rules: not a rule.
NOT_CHECKED = ("<nil>", "Invalid value: null: some validation rules were not checked because "
               "the object was invalid; correct the existing errors to complete validation")


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


def causes(call: Callable[[], Any]) -> list[Cause]:
    """The (field, message) of every cause of the 422 the call must get."""
    with pytest.raises(ApiException) as err:
        call()
    assert err.value.status == 422, err.value.body
    found = json.loads(err.value.body)["details"]["causes"]
    return [(c["field"], c["message"]) for c in found if (c["field"], c["message"]) != NOT_CHECKED]


def test_table_has_at_least_30_distinct_mistakes() -> None:
    assert len(INVALID) >= 30
    assert len({case[0] for case in INVALID}) == len(INVALID)


@pytest.mark.parametrize(("mutation", "expected"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_spec_is_rejected_with_the_rules_exact_message(
        api: client.CustomObjectsApi, kube_namespace: str, mutation: Mutation,
        expected: list[Cause]) -> None:
    manifest = make_job_manifest("bad")
    mutation(manifest)
    assert sorted(causes(lambda: create(api, kube_namespace, manifest))) == sorted(expected)


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
    # nprocPerNode has no stored default: unset means one rank per GPU, else one.
    assert stored["strategy"] == "ddp" and "nprocPerNode" not in stored
    assert stored["template"] == {"podSecurity": "Restricted"}
    assert stored["trainer"]["model"] == "gpt-tiny"
    # No batch default is stored: a user script's DataLoader decides (the Session checks a set
    # one against it); the built-in trainer falls back to its own 8 and 2.
    assert "globalBatchSize" not in stored["trainer"]
    assert "microBatchSize" not in stored["trainer"]
    assert stored["rendezvous"]["port"] == 29400
    assert stored["rendezvous"]["store"] == {"readyTimeoutSeconds": 600}
    assert stored["restartPolicy"] == {"maxRestarts": 3, "backoffSeconds": 10,
                                       "maxBackoffSeconds": 300}
    assert stored["terminationGracePeriodSeconds"] == 120 and stored["suspend"] is False
    assert stored["spares"] == 0
    # No stored mode: the operator picks InProcess where the job can run it (status says).
    assert "mode" not in stored["recovery"]


def test_full_job_is_accepted(api: client.CustomObjectsApi, kube_namespace: str) -> None:
    manifest = make_job_manifest(
        "full", replicas=4, minReplicas=2, maxReplicas=8, nprocPerNode="auto", strategy="fsdp",
        command=["torchrun"], args=["-m", "elastrain_trainer"],
        env=[{"name": "A", "value": "1"},
             {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        resources={"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 8}},
        trainer={"model": "gpt-100m", "precision": "bf16", "cpuOffload": True,
                 "activationCheckpointing": True, "lrSchedule": "wsd", "globalBatchSize": 64,
                 "microBatchSize": 4, "spikeFactor": 3.0,
                 "dataset": "s3://corpus/fineweb10B/fineweb_train_*.bin, s3://corpus/extra.bin",
                 "datasetFormat": "llmc", "vocabSize": 50304,
                 "validation": {"dataset": "s3://corpus/fineweb10B/fineweb_val_*.bin",
                                "intervalSteps": 250, "batches": 20}},
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
    assert stored["trainer"]["validation"]["batches"] == 20


def test_fsdp_is_admitted_in_process(api: client.CustomObjectsApi, kube_namespace: str) -> None:
    manifest = make_job_manifest("inprocess-fsdp", strategy="fsdp",
                                 recovery={"mode": "InProcess"})
    stored = create(api, kube_namespace, manifest)["spec"]
    assert (stored["strategy"], stored["recovery"]["mode"]) == ("fsdp", "InProcess")


def test_several_ranks_per_pod_are_admitted_in_process_when_asked(
        api: client.CustomObjectsApi, kube_namespace: str) -> None:
    """A pod's local ranks are one member of the in-process world (issue 35 item 1)."""
    manifest = make_job_manifest("inprocess-ranks", nprocPerNode=2, strategy="hsdp",
                                 recovery={"mode": "InProcess"})
    stored = create(api, kube_namespace, manifest)["spec"]
    assert (stored["nprocPerNode"], stored["strategy"], stored["recovery"]["mode"]) == (
        2, "hsdp", "InProcess")


def test_a_gpu_job_is_admitted_in_process_when_asked(api: client.CustomObjectsApi,
                                                     kube_namespace: str) -> None:
    """Experimental (issue 35 item 3): admitted, with error handling that keeps the process."""
    manifest = make_job_manifest("inprocess-gpu", nprocPerNode=8, strategy="hsdp",
                                 recovery={"mode": "InProcess"},
                                 resources={"limits": {"nvidia.com/gpu": 8}},
                                 env=[{"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "2"}])
    stored = create(api, kube_namespace, manifest)["spec"]
    assert (stored["recovery"]["mode"], stored["resources"]["limits"]["nvidia.com/gpu"]) == (
        "InProcess", 8)


@pytest.mark.parametrize("uri", ["gs://my_bucket.example/runs/1", "az://ckpts/runs/1",
                                 "abfs://ckpts@acct.dfs.core.windows.net/runs/1", "s3://ckpts",
                                 "file:///mnt/ckpts"])
def test_every_scheme_the_trainer_supports_is_admitted(
        api: client.CustomObjectsApi, kube_namespace: str, uri: str) -> None:
    name = "scheme-" + uri.partition(":")[0]
    stored = create(api, kube_namespace, make_job_manifest(name, checkpoint={"uri": uri}))
    assert stored["spec"]["checkpoint"]["uri"] == uri


IMMUTABLE = "is immutable: changing it mid-run is not supported"


@pytest.mark.parametrize(("patch", "expected"), [
    ({"strategy": "fsdp"}, ("spec.strategy", f"Forbidden: spec.strategy {IMMUTABLE}")),
    ({"checkpoint": {"uri": "s3://bucket/other"}},
     ("spec.checkpoint.uri", f"Forbidden: spec.checkpoint.uri {IMMUTABLE}")),
    ({"trainer": {"model": "gpt-small"}},
     ("spec.trainer.model", f"Forbidden: spec.trainer.model {IMMUTABLE}")),
    ({"maxReplicas": 8}, ("spec.maxReplicas", f"Forbidden: spec.maxReplicas {IMMUTABLE}")),
    ({"maxReplicas": None}, ("spec.maxReplicas", "Forbidden: spec.maxReplicas is immutable: "
                                                 "it cannot be added or removed after creation")),
    ({"rendezvous": {"port": 29500}},
     ("spec.rendezvous", f"Forbidden: spec.rendezvous {IMMUTABLE}")),
    ({"recovery": {"mode": "InProcess"}},
     ("spec.recovery", f"Forbidden: spec.recovery {IMMUTABLE}")),
])
def test_immutable_fields(api: client.CustomObjectsApi, kube_namespace: str,
                          patch: dict[str, Any], expected: Cause) -> None:
    create(api, kube_namespace, make_job_manifest("imm", checkpoint=S3))
    assert causes(lambda: api.patch_namespaced_custom_object(
        GROUP, VERSION, kube_namespace, PLURAL, "imm", {"spec": patch})) == [expected]


@pytest.mark.parametrize("patch", [
    {"command": ["torchrun", "train.py"]},  # InProcess (the built-in trainer) -> Restart
    {"resources": {"limits": {"nvidia.com/gpu": 1}}},
])
def test_an_unset_mode_is_kept_across_updates(api: client.CustomObjectsApi,
                                              kube_namespace: str, patch: dict[str, Any]) -> None:
    """The pods of a job whose mode is unset speak the protocol it started with: an update
    that would change what the unset mode picks is refused; with the mode set, it is not."""
    create(api, kube_namespace, make_job_manifest("unset-mode"))
    assert causes(lambda: api.patch_namespaced_custom_object(
        GROUP, VERSION, kube_namespace, PLURAL, "unset-mode", {"spec": patch})) == [
        rule("spec.recovery.mode", DEFAULT_MODE_CHANGE_MESSAGE)]
    create(api, kube_namespace, make_job_manifest("set-mode", recovery={"mode": "Restart"}))
    patched = api.patch_namespaced_custom_object(GROUP, VERSION, kube_namespace, PLURAL,
                                                 "set-mode", {"spec": patch})
    assert patched["spec"]["recovery"]["mode"] == "Restart"
    # An update that keeps what the unset mode picks is admitted.
    api.patch_namespaced_custom_object(GROUP, VERSION, kube_namespace, PLURAL, "unset-mode",
                                       {"spec": {"command": ["python", "-m",
                                                             "elastrain_trainer.launch", "t.py"]}})


def test_kubectl_columns_and_scale(api: client.CustomObjectsApi, crd: Any,
                                   kube_namespace: str) -> None:
    create(api, kube_namespace, make_job_manifest("cols"))
    api.patch_namespaced_custom_object_status(GROUP, VERSION, kube_namespace, PLURAL, "cols", {
        "status": {"phase": "Running", "workers": "2/2", "replicas": 2, "readyReplicas": 2,
                   "selector": "elastrain.dev/job-name=cols", "restarts": 1, "preemptions": 3,
                   "progress": {"step": 42, "totalSteps": 100, "loss": 2.5,
                                "checkpointHealth": {"consecutiveFailures": 2}},
                   "lastCheckpoint": {"step": 40, "uri": "s3://b/p/step-40"}}})

    out = kubectl(crd, "get", "tj", "cols", "-n", kube_namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "WORKERS", "STEP", "LAST", "CHECKPOINT",
                              "RESTARTS", "PREEMPTIONS", "FAILED", "SAVES", "AGE", "STORE",
                              "QUEUE"]
    assert out[1].split()[:8] == ["cols", "Running", "2/2", "42", "40", "1", "3", "2"]
    wide = kubectl(crd, "get", "tj", "cols", "-n", kube_namespace, "-o", "wide").stdout
    assert "STRATEGY" in wide and "RECOVERY" in wide and "2.5" in wide
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


def test_spares_are_admitted_in_process_mutable_and_bound_a_scale(
        api: client.CustomObjectsApi, crd: Any, kube_namespace: str) -> None:
    manifest = make_job_manifest("spares", recovery={"mode": "InProcess"}, spares=2)
    del manifest["spec"]["maxReplicas"]
    assert create(api, kube_namespace, manifest)["spec"]["spares"] == 2
    # Every spare is a worker pod: a scale past the bound on pods is refused naming spares.
    refused = kubectl(crd, "scale", "tj/spares", "-n", kube_namespace,
                      f"--replicas={MAX_WORKERS - 1}", check=False)
    assert refused.returncode != 0 and SPARES_BOUND_MESSAGE in refused.stderr, refused.stderr
    patched = api.patch_namespaced_custom_object(GROUP, VERSION, kube_namespace, PLURAL,
                                                 "spares", {"spec": {"spares": 0}})
    assert patched["spec"]["spares"] == 0
