"""The job's Kueue Workload (kueue.x-k8s.io/v1beta2), and the placement an admission gives pods.

A TrainingJob under Kueue (policy.kueue) is one Workload the operator creates and owns, as
Kueue's own job integrations do (its jobframework reconciler, which a controller not written in
Go cannot import): pod sets for the workers (count = the desired workers, minCount =
minReplicas, so partial admission can start it smaller), the warm spares and the rendezvous
store, so every pod the job creates is inside the admitted quota. Each pod set's template is
the pod the operator would create, so Kueue's flavor assignment sees its real requests, node
selector, tolerations and affinity.

Once admitted, each pod set's assignment names a ResourceFlavor per resource; the flavors'
nodeLabels and tolerations, and any podSetUpdates of the admission checks, are merged into the
pods as Kueue's podset.Merge does for its own jobs (place()).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from elastrain_operator.model.names import LABEL_JOB
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.meta import Manifest, owner_reference
from elastrain_operator.render.rendezvous import render_store_pod
from elastrain_operator.render.workers import render_worker_pod

KUEUE_API: Final = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL: Final = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass
JOB_UID_LABEL: Final = "kueue.x-k8s.io/job-uid"
# Kueue's jobframework puts it on every Workload it makes: the Workload stays until its job's
# controller has let the quota go (finished) or seen its deletion.
RESOURCE_IN_USE: Final = "kueue.x-k8s.io/resource-in-use"
# On a Workload the operator deactivated (spec.active false) because its job is suspended: only
# such a one is activated again on the job's resume, never one an administrator deactivated.
DEACTIVATED_BY: Final = "elastrain.dev/deactivated-by"
SUSPEND: Final = "spec.suspend"
POD_SETS_HASH: Final = "elastrain.dev/pod-sets-hash"
WORKERS: Final = "workers"
SPARES: Final = "spares"
STORE: Final = "store"
POD_SETS: Final = (WORKERS, SPARES, STORE)
# Workload slices (Kueue's ElasticJobsViaWorkloadSlices gate, policy.kueue_slices): a slice names
# the admitted Workload it is to replace ("<namespace>/<name>"); Kueue's scheduler admits it in
# the quota of both and finishes the old one with reason SLICE_REPLACED.
REPLACEMENT_FOR: Final = "kueue.x-k8s.io/workload-slice-replacement-for"
SLICE_REPLACED: Final = "WorkloadSliceReplaced"
SLICE_INDEX: Final = "elastrain.dev/workload-slice"  # 1 for the job's first Workload


@dataclass(frozen=True)
class Priority:
    """The class Kueue orders the Workload by, with its value (Kueue's webhook does not
    resolve a class a controller names; its jobframework does that before it creates one)."""

    kind: str  # "WorkloadPriorityClass" or "PriorityClass"
    name: str
    value: int

    def ref(self) -> Manifest:
        group = "kueue.x-k8s.io" if self.kind == "WorkloadPriorityClass" else "scheduling.k8s.io"
        return {"group": group, "kind": self.kind, "name": self.name}


def workload_name(job: TrainingJob) -> str:
    """Unique per job object, as Kueue names its own (kind, name, a hash of the uid): a job
    deleted and created again under the same name never meets its predecessor's Workload."""
    digest = hashlib.sha256(f"{job.metadata.uid}/TrainingJob".encode()).hexdigest()[:5]
    return f"trainingjob-{job.metadata.name}-{digest}"


def extra_workload_name(job: TrainingJob) -> str:
    """The job's second Workload, for the workers its admission did not cover (policy.
    kueue_grow)."""
    return f"{workload_name(job)}-more"


def _template(pod: Manifest) -> Manifest:
    """A pod set's template: the pod's labels and spec (names and owners are per pod)."""
    return {"metadata": {"labels": dict(pod["metadata"].get("labels") or {})},
            "spec": pod["spec"]}


def render_workload(job: TrainingJob, queue: str, priority: Priority | None) -> Manifest:
    """The Workload that asks Kueue for the job's quota."""
    pod_sets = render_pod_sets(job)
    body: Manifest = {"queueName": queue, "podSets": pod_sets}
    if priority is not None:
        body["priorityClassRef"] = priority.ref()
        body["priority"] = priority.value
    annotations = {POD_SETS_HASH: pod_sets_hash(pod_sets)}
    if job.spec.suspend:  # created suspended: in no queue until resumed (policy.kueue)
        body["active"] = False
        annotations[DEACTIVATED_BY] = SUSPEND
    return {"apiVersion": KUEUE_API, "kind": "Workload", "spec": body, "metadata": {
        "name": workload_name(job),
        "namespace": job.metadata.namespace,
        "labels": {LABEL_JOB: job.metadata.name, JOB_UID_LABEL: job.metadata.uid},
        "annotations": annotations,
        "finalizers": [RESOURCE_IN_USE],
        "ownerReferences": [owner_reference(job)],
    }}


def slice_index(workload: Manifest) -> int:
    """Where a Workload stands in the job's chain of slices: 1 for the first."""
    notes = (workload.get("metadata") or {}).get("annotations") or {}
    try:
        return int(notes.get(SLICE_INDEX, "1"))
    except ValueError:
        return 1


def render_slice(job: TrainingJob, current: Manifest, floor: int) -> Manifest:
    """The Workload slice that asks to grow the admitted `current` one to the desired workers
    (policy.kueue_slices): the job's own pod sets, admitted from `floor` workers up (partial
    admission; below it nothing would grow), its LocalQueue and priority."""
    spec = current.get("spec") or {}
    pod_sets = render_pod_sets(job)
    workers = pod_sets[0]
    workers.pop("minCount", None)
    if floor < workers["count"]:
        workers["minCount"] = floor
    body: Manifest = {"queueName": spec.get("queueName"), "podSets": pod_sets}
    for key in ("priorityClassRef", "priority"):
        if key in spec:
            body[key] = spec[key]
    meta = current.get("metadata") or {}
    index = slice_index(current) + 1
    return {"apiVersion": KUEUE_API, "kind": "Workload", "spec": body, "metadata": {
        "name": f"{workload_name(job)}-{index}",
        "namespace": job.metadata.namespace,
        "labels": {LABEL_JOB: job.metadata.name, JOB_UID_LABEL: job.metadata.uid},
        "annotations": {POD_SETS_HASH: pod_sets_hash(pod_sets), SLICE_INDEX: str(index),
                        REPLACEMENT_FOR: f"{meta.get('namespace')}/{meta.get('name')}"},
        "finalizers": [RESOURCE_IN_USE],
        "ownerReferences": [owner_reference(job)],
    }}


def render_extra_workload(job: TrainingJob, main: Manifest, workers: int) -> Manifest:
    """A Workload for `workers` more workers beside the admitted `main` one (policy.
    kueue_grow): its LocalQueue and priority, one pod set of the workers' template, any size
    from one worker up (partial admission). No finalizer: Kueue frees its quota when it is
    deleted, which the operator does only once its workers are gone."""
    spec = main.get("spec") or {}
    template = _template(render_worker_pod(job, 0, 0))
    body: Manifest = {"queueName": spec.get("queueName"), "podSets": [
        {"name": WORKERS, "count": workers, "template": template,
         **({"minCount": 1} if workers > 1 else {})}]}
    for key in ("priorityClassRef", "priority"):
        if key in spec:
            body[key] = spec[key]
    return {"apiVersion": KUEUE_API, "kind": "Workload", "spec": body, "metadata": {
        "name": extra_workload_name(job),
        "namespace": job.metadata.namespace,
        "labels": {LABEL_JOB: job.metadata.name, JOB_UID_LABEL: job.metadata.uid},
        "ownerReferences": [owner_reference(job)],
    }}


def pod_sets_hash(pod_sets: Sequence[Manifest]) -> str:
    """What the pod sets were rendered from, in short: a job whose spec changed while its
    Workload holds no quota gets them again (policy.kueue)."""
    return hashlib.sha256(json.dumps(pod_sets, sort_keys=True).encode()).hexdigest()[:16]


def render_pod_sets(job: TrainingJob) -> list[Manifest]:
    """The workers', the spares' and the store's pod sets."""
    spec = job.spec
    desired = spec.desired_workers
    workers: Manifest = {"name": WORKERS, "count": desired,
                         "template": _template(render_worker_pod(job, 0, 0))}
    if spec.min_replicas < desired:
        workers["minCount"] = spec.min_replicas
    pod_sets = [workers]
    if spec.spares:
        pod_sets.append({"name": SPARES, "count": spec.spares,
                         "template": _template(render_worker_pod(job, desired, 0))})
    pod_sets.append({"name": STORE, "count": 1, "template": _template(render_store_pod(job))})
    return pod_sets


@dataclass(frozen=True)
class Placement:
    """What an admission adds to one pod set's pods."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Manifest] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    def merged(self, other: Placement) -> Placement:
        return Placement(
            node_selector={**self.node_selector, **other.node_selector},
            tolerations=(*self.tolerations,
                         *(t for t in other.tolerations if t not in self.tolerations)),
            labels={**self.labels, **other.labels},
            annotations={**self.annotations, **other.annotations})


def flavor_placement(flavor: Mapping[str, Any]) -> Placement:
    """A ResourceFlavor's nodeLabels and tolerations, as they go onto an admitted pod."""
    spec = flavor.get("spec") or {}
    return Placement(node_selector=dict(spec.get("nodeLabels") or {}),
                     tolerations=tuple(spec.get("tolerations") or ()))


def update_placement(update: Mapping[str, Any]) -> Placement:
    """An admission check's podSetUpdate."""
    return Placement(node_selector=dict(update.get("nodeSelector") or {}),
                     tolerations=tuple(update.get("tolerations") or ()),
                     labels=dict(update.get("labels") or {}),
                     annotations=dict(update.get("annotations") or {}))


def place(pod: Manifest, placement: Placement) -> Manifest:
    """The pod with an admission's placement merged in; a node selector key the job set itself
    to another value is a conflict Kueue refuses too (ValueError names it)."""
    if not (placement.node_selector or placement.tolerations or placement.labels
            or placement.annotations):
        return pod
    spec = dict(pod["spec"])
    selector = dict(spec.get("nodeSelector") or {})
    for key, value in placement.node_selector.items():
        if selector.get(key, value) != value:
            raise ValueError(f"the admission's node label {key}={value} conflicts with the "
                             f"pod's nodeSelector {key}={selector[key]}")
        selector[key] = value
    if selector:
        spec["nodeSelector"] = selector
    tolerations = list(spec.get("tolerations") or [])
    tolerations += [t for t in placement.tolerations if t not in tolerations]
    if tolerations:
        spec["tolerations"] = tolerations
    metadata = dict(pod["metadata"])
    metadata["labels"] = {**placement.labels, **metadata.get("labels", {})}
    if placement.annotations:
        metadata["annotations"] = {**placement.annotations, **metadata.get("annotations", {})}
    return {**pod, "metadata": metadata, "spec": spec}


def with_admitted_workers(pod: Manifest, workers: int) -> Manifest:
    """A worker pod told the admitted world (partial admission): an in-process job's first
    generation waits for ELASTRAIN_REPLICAS nodes, which must not be more than were admitted."""
    containers = []
    for container in pod["spec"]["containers"]:
        env = [{**e, "value": str(workers)} if e.get("name") == "ELASTRAIN_REPLICAS" else e
               for e in container.get("env") or []]
        containers.append({**container, "env": env})
    return {**pod, "spec": {**pod["spec"], "containers": containers}}
