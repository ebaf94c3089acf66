"""Render the TrainingJob CustomResourceDefinition from the pydantic models.

pydantic speaks JSON Schema; a CRD needs a *structural* OpenAPI v3 schema: no $ref, no nullable
unions, no `const`, no `additionalProperties` beside `properties`. `structural()` converts one
into the other; the CRD's subresources and printer columns are declared here.
`python -m elastrain_operator.render.crd` prints the YAML that `make crds` commits.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from elastrain_operator.model.spec import (
    API_GROUP,
    API_VERSION,
    CATEGORIES,
    KIND,
    PLURAL,
    ROOT_RULES,
    SHORT_NAMES,
    SINGULAR,
    TrainingJobSpec,
)
from elastrain_operator.model.status import TrainingJobStatus

Schema = dict[str, Any]
_DROP = {"title", "$defs"}


def _resolve(node: Schema, defs: Schema) -> Schema:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return {**target, **rest}
    return node


def _strip_null(node: Schema) -> Schema:
    """`X | None` becomes X: optional fields are simply not required."""
    options = node.get("anyOf")
    if not options:
        return node
    kept = [o for o in options if o.get("type") != "null"]
    if len(kept) == len(options):
        return node
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    if rest.get("default", 0) is None:
        del rest["default"]
    if len(kept) == 1:
        return {**kept[0], **rest}
    return {**rest, "anyOf": kept}


def structural(node: Schema, defs: Schema, *, required: bool = True) -> Schema:
    """Convert one pydantic JSON Schema node (and its children) into a structural schema."""
    resolved = _resolve(node, defs)
    node = _resolve(_strip_null(resolved), defs)
    optional = node is not resolved  # `X | None`: absent means "not configured", so no default
    out: Schema = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "properties":
            req = set(node.get("required", []))
            out[key] = {name: structural(sub, defs, required=name in req)
                        for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = structural(value, defs)
        elif key == "additionalProperties" and isinstance(value, bool):
            continue  # closed objects are pruned by the apiserver; open ones preserve fields
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            # JSON Schema 2020-12 gives the bound; OpenAPI v3.0 a flag beside minimum/maximum.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "anyOf":
            # int-or-string: the apiserver only accepts exactly this pair of bare types.
            out[key] = [{"type": o["type"]} for o in value]
        else:
            out[key] = value
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    # A nested object with defaults inside gets `default: {}`, so the apiserver fills them in.
    if (not required and not optional and "properties" in out and "default" not in out
            and not out.get("required") and out.get("type") == "object"):
        out["default"] = {}
    return out


def model_schema(model: type[Any]) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


PRINTER_COLUMNS: list[Schema] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Workers", "type": "string", "jsonPath": ".status.workers",
     "description": "Ready/desired workers"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Last Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpoint.step",
     "description": "Step of the newest committed checkpoint"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Preemptions", "type": "integer", "jsonPath": ".status.preemptions"},
    {"name": "Failed Saves", "type": "integer",
     "jsonPath": ".status.progress.checkpointHealth.consecutiveFailures",
     "description": "Checkpoint saves that failed in a row (see the CheckpointsFailing condition)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Strategy", "type": "string", "jsonPath": ".spec.strategy", "priority": 1},
    {"name": "Recovery", "type": "string", "jsonPath": ".status.recoveryMode", "priority": 1},
    {"name": "Min", "type": "integer", "jsonPath": ".spec.minReplicas", "priority": 1},
    {"name": "Max", "type": "integer", "jsonPath": ".spec.maxReplicas", "priority": 1},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "priority": 1},
    {"name": "Checkpointed", "type": "date", "jsonPath": ".status.lastCheckpoint.time",
     "priority": 1},
    # Last, so the columns before it keep their places for scripts that read them by position.
    {"name": "Store", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="RendezvousStoreReady")].reason',
     "description": "The rendezvous store pod: StoreReady, or why it is not Ready"},
    {"name": "Queue", "type": "string", "jsonPath": ".status.queue.state",
     "description": "Kueue: Queued, Admitted or Evicted (status.queue says why)"},
]


def build_crd() -> Schema:
    """The TrainingJob CRD as a manifest."""
    spec = model_schema(TrainingJobSpec)
    status = model_schema(TrainingJobStatus)
    status.pop("default", None)
    root: Schema = {
        "type": "object",
        "description": "An elastic PyTorch training job that survives preemption.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Declared so that the root's CEL rules may name metadata.name as their fieldPath.
            "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
            "spec": spec,
            "status": status,
        },
        **ROOT_RULES,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "versions": [{
                "name": API_VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": root},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def render_crd_yaml() -> str:
    header = ("# Generated by `make crds` from operator/elastrain_operator/model/. Do not edit.\n")
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main() -> None:
    sys.stdout.write(render_crd_yaml())


if __name__ == "__main__":
    main()
