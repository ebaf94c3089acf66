"""Worker pods: one per slot and attempt, rendered purely from the job.

A worker has a stable hostname (`<job>-worker-<index>`) in the headless Service's subdomain, so
torchrun's rank-0 address resolves no matter which attempt of the slot is running. The pod name
carries the attempt, so a replacement can start while its predecessor is still terminating
(checkpointing on SIGTERM). restartPolicy is Never: a container that exits must surface to the
operator, which tells preemption from failure and keeps the job's budgets.
"""

from __future__ import annotations

from typing import Any

from elastrain_operator.model.names import (
    LABEL_ATTEMPT,
    LABEL_INDEX,
    METRICS_PORT_NAME,
    ROLE_WORKER,
    TRAINER_CONTAINER,
    WORKER_FINALIZER,
    worker_hostname,
    worker_pod_name,
    worker_service_name,
)
from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.control import control_volume, controlled
from elastrain_operator.render.env import render_command, render_worker_env
from elastrain_operator.render.meta import Manifest, child_metadata
from elastrain_operator.render.node_loss import with_node_loss_tolerations
from elastrain_operator.render.security import (
    container_security_context,
    pod_security_context,
    scratch_volumes,
)


def _resources(job: TrainingJob) -> Manifest:
    """The spec's resources; a GPU (an extended resource) gets limits = requests, as the
    apiserver requires, whichever of the two the user wrote."""
    res = job.spec.resources.to_api()
    for key in [*res.get("limits", {}), *res.get("requests", {})]:
        if key.endswith("/gpu"):
            value = res.get("limits", {}).get(key, res.get("requests", {}).get(key))
            res.setdefault("limits", {})[key] = value
            res.setdefault("requests", {})[key] = value
    return {k: v for k, v in res.items() if v}


def _tolerations(job: TrainingJob) -> list[Manifest]:
    """The user's tolerations, plus the `<vendor>/gpu` NoSchedule taint GPU node pools carry
    (EKS and GKE taint them so) when the job asks for that GPU and does not tolerate it yet,
    and a lost node's taints for spec.recovery.nodeLossTolerationSeconds (render.node_loss)."""
    tolerations = [x.to_api() for x in job.spec.template.tolerations]
    res = job.spec.resources
    for key in dict.fromkeys(k for k in [*res.limits, *res.requests] if k.endswith("/gpu")):
        if not any(t.get("key") == key for t in tolerations):
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoSchedule"})
    return with_node_loss_tolerations(job, tolerations)


def _mounts(job: TrainingJob) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, volumeMounts): the user's, then the writable scratch of a read-only root
    filesystem where the user mounts nothing of their own."""
    t = job.spec.template
    volumes, mounts = list(t.volumes), list(t.volume_mounts)
    taken = {m.get("mountPath") for m in mounts}
    scratch, scratch_mounts = scratch_volumes(job.spec, shm=True)
    for volume, mount in zip(scratch, scratch_mounts, strict=True):
        if mount["mountPath"] not in taken:
            volumes.append(volume)
            mounts.append(mount)
    if controlled(job):
        volume, mount = control_volume(job)
        volumes.append(volume)
        mounts.append(mount)
    return volumes, mounts


def _container(job: TrainingJob, mounts: list[Manifest]) -> Manifest:
    spec = job.spec
    container: Manifest = {
        "name": TRAINER_CONTAINER,
        "image": spec.image,
        "command": render_command(spec),
        "env": render_worker_env(spec, namespace=job.metadata.namespace,
                                 job_uid=job.metadata.uid, job_name=job.metadata.name),
        # A failed container's log tail lands in its status, where the operator reads why torchrun
        # exited (policy/failures.py) and users see it without the pod's logs.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(spec.template),
    }
    if spec.args:
        container["args"] = list(spec.args)
    if spec.metrics_port:
        container["ports"] = [{"name": METRICS_PORT_NAME, "containerPort": spec.metrics_port,
                               "protocol": "TCP"}]
    if resources := _resources(job):
        container["resources"] = resources
    container["volumeMounts"] = mounts
    if spec.template.image_pull_policy:
        container["imagePullPolicy"] = spec.template.image_pull_policy
    return container


def _template_fields(job: TrainingJob, volumes: list[Manifest]) -> Manifest:
    """The user's narrow pod template override, each field only when set."""
    t = job.spec.template
    fields: dict[str, Any] = {
        "nodeSelector": dict(t.node_selector) or None,
        "tolerations": _tolerations(job) or None,
        "affinity": t.affinity,
        "priorityClassName": t.priority_class_name,
        "schedulerName": t.scheduler_name,
        "serviceAccountName": t.service_account_name,
        "imagePullSecrets": [{"name": n} for n in t.image_pull_secrets] or None,
        "volumes": volumes,
        "securityContext": pod_security_context(t),
    }
    return {k: v for k, v in fields.items() if v is not None}


def render_worker_pod(job: TrainingJob, index: int, attempt: int) -> Manifest:
    """The pod of worker slot `index`, attempt `attempt`."""
    name = job.metadata.name
    t = job.spec.template
    metadata = child_metadata(
        job, worker_pod_name(name, index, attempt), role=ROLE_WORKER,
        extra_labels={**t.labels, LABEL_INDEX: str(index), LABEL_ATTEMPT: str(attempt)})
    if t.annotations:
        metadata["annotations"] = dict(t.annotations)
    metadata["finalizers"] = [WORKER_FINALIZER]
    volumes, mounts = _mounts(job)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "hostname": worker_hostname(name, index),
            "subdomain": worker_service_name(name),
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": job.spec.termination_grace_period_seconds,
            **_template_fields(job, volumes),
            "containers": [_container(job, mounts)],
        },
    }
