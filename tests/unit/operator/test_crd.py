"""The committed CRD is exactly what the models generate, and it is structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastrain_operator.render.crd import build_crd, render_crd_yaml

ROOT = Path(__file__).resolve().parents[3]
CRD_FILE = ROOT / "crds" / "trainingjobs.elastrain.dev.yaml"


def test_committed_crd_matches_the_models() -> None:
    assert CRD_FILE.read_text() == render_crd_yaml(), (
        "crds/trainingjobs.elastrain.dev.yaml is stale: run `make crds` and commit the result")


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found.extend(_walk(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_walk(value, f"{path}[{i}]"))
    return found


def test_schema_is_structural() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node, path
        assert "const" not in node, path
        assert not ("properties" in node and "additionalProperties" in node), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        assert node.get("type") != "null", path
        for flag in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(flag, True) is True, path  # OpenAPI v3.0: a boolean


def test_every_cel_rule_names_a_field() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [r for _, node in _walk(schema) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 10
    for rule in rules:
        assert rule["message"].startswith(("spec.", "metadata.name ")), rule
    root = schema["x-kubernetes-validations"]
    assert {r["fieldPath"] for r in root} == {".metadata.name"}
    assert all(r["message"].startswith("metadata.name ") for r in root)


def test_subresources_and_columns() -> None:
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    names = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert names == ["Phase", "Workers", "Step", "Last Checkpoint", "Restarts", "Preemptions",
                     "Failed Saves", "Age", "Store", "Queue"]
    status_props = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"].split("[", 1)[0].split(".")
        if path[1] == "status":
            assert path[2] in status_props, column
