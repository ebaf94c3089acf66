"""Builders for TrainingJob manifests used across operator tests."""

from __future__ import annotations

import copy
from typing import Any


def make_job_manifest(name: str = "demo", **spec_overrides: Any) -> dict[str, Any]:
    """A minimal valid TrainingJob manifest; keyword arguments override top-level spec fields."""
    spec: dict[str, Any] = {"image": "elastrain/trainer:dev", "replicas": 2, "minReplicas": 1,
                            "maxReplicas": 4}
    spec.update(copy.deepcopy(spec_overrides))
    return {
        "apiVersion": "elastrain.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": spec,
    }
