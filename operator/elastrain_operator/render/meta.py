"""Metadata every child shares: the controller owner reference and the job's labels."""

from __future__ import annotations

from typing import Any

from elastrain_operator.model.names import LABEL_ROLE, job_labels
from elastrain_operator.model.spec import TrainingJob

Manifest = dict[str, Any]


def owner_reference(job: TrainingJob) -> Manifest:
    """controller=True so the garbage collector deletes children with the job, and so nobody
    else adopts them; blockOwnerDeletion for foreground deletion."""
    return {"apiVersion": job.api_version, "kind": job.kind, "name": job.metadata.name,
            "uid": job.metadata.uid, "controller": True, "blockOwnerDeletion": True}


def child_metadata(job: TrainingJob, name: str, *, role: str,
                   extra_labels: dict[str, str] | None = None) -> Manifest:
    labels = {**(extra_labels or {}), **job_labels(job.metadata.name), LABEL_ROLE: role}
    return {"name": name, "namespace": job.metadata.namespace, "labels": labels,
            "ownerReferences": [owner_reference(job)]}
