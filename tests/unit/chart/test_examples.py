"""Every example is a valid TrainingJob (the operator's own model parses it), keeps its global
batch divisible at every world size it can shrink or grow to, and sizes its termination grace to
its provider's preemption notice; the kind example fits the kind cluster it is written for."""

from __future__ import annotations

from math import lcm
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.unit.chart.chartlib import EXAMPLES, ROOT, Manifest, load_docs

K8S_SCHEMA_VERSION = "1.34.0"
# Seconds between a provider's preemption notice and the machine going away.
NOTICE_SECONDS = {"eks": 120, "gke": 30}


def _jobs() -> list[tuple[Path, Manifest]]:
    return [(path, doc) for path in EXAMPLES for doc in load_docs(path)
            if doc.get("kind") == "TrainingJob"]


JOBS = _jobs()
JOB_IDS = [f"{p.parent.name}/{p.stem}/{d['metadata']['name']}" for p, d in JOBS]


def test_examples_cover_kind_eks_and_gke() -> None:
    assert {p.parent.name for p, _ in JOBS} >= {"kind", "eks", "gke"}
    assert any(d["spec"].get("strategy") == "fsdp" for p, d in JOBS if p.parent.name == "eks")
    assert any(d["spec"].get("strategy") == "fsdp" for p, d in JOBS if p.parent.name == "gke")


@pytest.mark.parametrize(("path", "doc"), JOBS, ids=JOB_IDS)
def test_example_parses_with_the_operator_model(path: Path, doc: Manifest) -> None:
    from elastrain_operator.model import TrainingJob

    job = TrainingJob.model_validate(doc)
    assert job.metadata.namespace == doc["metadata"]["namespace"]


def _crd_schema() -> dict[str, object]:
    crd = yaml.safe_load((ROOT / "crds" / "trainingjobs.elastrain.dev.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    schema: dict[str, object] = version["schema"]["openAPIV3Schema"]
    return schema


def _closed(schema: object) -> object:
    """Structural schemas prune unknown fields; for an offline check refuse them instead."""
    if isinstance(schema, dict):
        closed = {k: _closed(v) for k, v in schema.items()}
        if "properties" in closed and not schema.get("x-kubernetes-preserve-unknown-fields"):
            closed.setdefault("additionalProperties", False)
        return closed
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _offline_schema() -> dict[str, object]:
    """The closed schema, except the root's metadata: the apiserver keeps all of ObjectMeta and
    a CRD may only restrict its name there."""
    schema = _crd_schema()
    closed = _closed(schema)
    assert isinstance(closed, dict)
    closed["properties"]["metadata"] = schema["properties"]["metadata"]  # type: ignore[index]
    return closed


@pytest.mark.parametrize(("path", "doc"), JOBS, ids=JOB_IDS)
def test_example_validates_offline_against_the_crd_schema(path: Path, doc: Manifest) -> None:
    # OpenAPI v3 schemas in CRDs use draft-4 semantics (boolean exclusiveMinimum).
    validator = jsonschema.Draft4Validator(_offline_schema())
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(doc)]
    assert not errors


def test_offline_crd_schema_check_can_fail() -> None:
    _, doc = JOBS[0]
    bad = {**doc, "spec": {**doc["spec"], "replicas": "two", "typo": 1}}
    validator = jsonschema.Draft4Validator(_offline_schema())
    messages = " ".join(e.message for e in validator.iter_errors(bad))
    assert "'two' is not of type 'integer'" in messages and "typo" in messages


@pytest.mark.parametrize(("path", "doc"), JOBS, ids=JOB_IDS)
def test_global_batch_divides_every_allowed_world_size(path: Path, doc: Manifest) -> None:
    from elastrain_operator.model import TrainingJob

    spec = TrainingJob.model_validate(doc).spec
    if spec.trainer.global_batch_size is None:  # a script's own batch (examples/byo: its loader)
        assert spec.command is not None, "the built-in trainer's examples set their batch"
        return
    nproc = spec.effective_nproc_per_node
    assert isinstance(nproc, int), "examples pin nprocPerNode or request GPUs"
    sizes = [n * nproc for n in range(spec.min_replicas,
                                                     spec.effective_max_replicas + 1)]
    assert spec.max_replicas is not None, "an example bounds maxReplicas"
    global_batch, micro_batch = spec.trainer.batch
    step = micro_batch * lcm(*sizes)
    assert global_batch % step == 0, (
        f"globalBatchSize must be a multiple of {step} for world sizes {sizes}")


@pytest.mark.parametrize(("path", "doc"), JOBS, ids=JOB_IDS)
def test_termination_grace_fits_the_providers_notice(path: Path, doc: Manifest) -> None:
    provider = path.parent.name
    grace = doc["spec"]["terminationGracePeriodSeconds"]
    if provider in NOTICE_SECONDS:
        assert NOTICE_SECONDS[provider] * 0.75 <= grace < NOTICE_SECONDS[provider]


@pytest.mark.parametrize(("path", "doc"),
                         [(p, d) for p, d in JOBS if p.parent.name in NOTICE_SECONDS],
                         ids=[i for i in JOB_IDS if i.split("/")[0] in NOTICE_SECONDS])
def test_cloud_examples_run_on_tolerated_spot_gpus_with_a_cloud_identity(
        path: Path, doc: Manifest) -> None:
    from elastrain_operator.model import TrainingJob
    from elastrain_operator.render.workers import render_worker_pod

    spec, docs = doc["spec"], load_docs(path)
    template = spec["template"]
    # What the operator makes of the GPU request: one rank per GPU, requests = limits, the
    # GPU taint tolerated, a /dev/shm sized for the ranks (issue 19's GPU-ready workers).
    gpus = spec["resources"]["limits"]["nvidia.com/gpu"]
    pod = render_worker_pod(TrainingJob.model_validate(doc), 0, 0)
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PET_NPROC_PER_NODE"] == str(gpus)
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["spec"]["tolerations"])
    assert {"name": "elastrain-shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{gpus}Gi"}} \
        in pod["spec"]["volumes"]
    selector = template["nodeSelector"]
    assert {"eks.amazonaws.com/capacityType": "SPOT"}.items() <= selector.items() or \
        {"cloud.google.com/gke-spot": "true"}.items() <= selector.items()
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert account["metadata"]["name"] == template["serviceAccountName"]
    identity = {"eks": "eks.amazonaws.com/role-arn", "gke": "iam.gke.io/gcp-service-account"}
    assert identity[path.parent.name] in account["metadata"]["annotations"]
    # The rendezvous store must not sit on the capacity that gets preempted.
    store = spec["rendezvous"]["store"]["nodeSelector"]
    assert not store.items() & selector.items()


@pytest.mark.parametrize("path", EXAMPLES, ids=[f"{p.parent.name}/{p.name}" for p in EXAMPLES])
def test_builtin_kinds_in_examples_validate(path: Path) -> None:
    for doc in load_docs(path):
        if doc["kind"] == "TrainingJob":
            continue
        kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)


def _kind_nodes() -> list[Manifest]:
    config = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    nodes = []
    for node in config["nodes"]:
        taints = []
        for patch in node.get("kubeadmConfigPatches", []):
            registration = yaml.safe_load(patch).get("nodeRegistration", {})
            taints += registration.get("taints", [])
        nodes.append({"role": node["role"], "labels": node.get("labels", {}), "taints": taints})
    return nodes


def _schedulable(selector: dict[str, str], tolerations: list[Manifest]) -> list[Manifest]:
    def tolerated(taint: Manifest) -> bool:
        return any(t.get("key") == taint["key"] and t.get("effect") in (None, taint["effect"])
                   and (t.get("operator") == "Exists" or t.get("value") == taint.get("value"))
                   for t in tolerations)
    return [n for n in _kind_nodes() if n["role"] == "worker"
            and selector.items() <= n["labels"].items()
            and all(tolerated(t) for t in n["taints"])]


def test_kind_job_fits_the_kind_cluster() -> None:
    (doc,) = [d for p, d in JOBS if p.parent.name == "kind"]
    spec = doc["spec"]
    workers = _schedulable(spec["template"]["nodeSelector"], spec["template"]["tolerations"])
    # One spot node can be drained while the job keeps running on the other.
    assert len(workers) >= 2 and spec["minReplicas"] < len(workers)
    assert _schedulable(spec["rendezvous"]["store"]["nodeSelector"], [])
    assert not set(map(id, workers)) & set(map(id, _schedulable(
        spec["rendezvous"]["store"]["nodeSelector"], [])))
    # MinIO runs where the drain does not reach, and the job's secret and endpoint exist there.
    minio = load_docs(ROOT / "examples" / "kind" / "minio.yaml")
    (deployment,) = [d for d in minio if d["kind"] == "Deployment"]
    assert _schedulable(deployment["spec"]["template"]["spec"]["nodeSelector"], [])
    secrets = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in minio
               if d["kind"] == "Secret"}
    assert (doc["metadata"]["namespace"],
            spec["checkpoint"]["credentialsSecret"]["name"]) in secrets
    (service,) = [d for d in minio if d["kind"] == "Service"]
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert host in spec["checkpoint"]["endpoint"]
    assert spec["template"]["imagePullPolicy"] != "Always", "kind-loaded images are not pullable"
