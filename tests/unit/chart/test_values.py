"""values.yaml is documented code: a comment on every key, camelCase, maps rather than lists, and
values.schema.json describes exactly the same tree and refuses anything else."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.unit.chart.chartlib import CHART, CI_VALUES, render_error

VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# Kubernetes objects passed through verbatim keep Kubernetes' own shapes (capabilities.drop is a
# list there); everything else the chart defines itself.
PASS_THROUGH = ("securityContext", "podSecurityContext", "resources", "affinity")
CAMEL = re.compile(r"^[a-z][a-zA-Z0-9]*$")


def walk(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, (*path, str(key)))


def test_every_key_has_a_comment() -> None:
    lines = VALUES_TEXT.splitlines()
    missing = []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match or line.lstrip().startswith("#"):
            continue
        above = lines[i - 1].strip() if i else ""
        if not above.startswith("#"):
            missing.append(f"line {i + 1}: {match.group(2)}")
    assert not missing, "keys without a comment above them:\n" + "\n".join(missing)


def test_keys_are_camel_case() -> None:
    bad = [".".join(p) for p, _ in walk(VALUES) if p and not CAMEL.match(p[-1])]
    assert not bad


def test_collections_are_maps_not_lists() -> None:
    lists = [".".join(p) for p, v in walk(VALUES)
             if isinstance(v, list) and p[0] not in PASS_THROUGH]
    assert not lists, f"use maps (name -> entry) instead of lists: {lists}"


def schema_paths(node: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for key, sub in node.get("properties", {}).items():
        yield from schema_paths(sub, (*path, key))


def test_schema_is_strict_everywhere() -> None:
    for path in schema_paths(SCHEMA):
        node = SCHEMA
        for key in path:
            node = node["properties"][key]
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, ".".join(path) or "<root>"


def test_schema_and_values_describe_the_same_tree() -> None:
    in_schema = set(schema_paths(SCHEMA)) - {("global",)}
    in_values = set()
    for path, _ in walk(VALUES):
        node = SCHEMA
        for key in path:  # stop at free-form maps (their keys are data, not settings)
            if "properties" not in node:
                break
            node = node["properties"].get(key, {})
        else:
            in_values.add(path)
    assert in_values - in_schema == set(), "values.yaml keys missing from values.schema.json"
    # The schema may describe optional keys only inside Kubernetes pass-through objects or maps
    # that default to empty; every setting of the chart's own appears in values.yaml.
    optional = {p for p in in_schema - in_values
                if p[0] in PASS_THROUGH or _lookup(VALUES, p[:1]) == {}}
    assert in_schema - in_values - optional == set(), "schema keys missing from values.yaml"


def _lookup(node: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def test_values_and_ci_files_satisfy_the_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(VALUES, SCHEMA)
    for path in CI_VALUES:
        merged = _merge(VALUES, yaml.safe_load(path.read_text()) or {})
        jsonschema.validate(merged, SCHEMA)


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in override.items()}}
    return override


@pytest.mark.parametrize("bad", [
    "replicaCount=-1",
    "image.pullPolicy=Sometimes",
    "image.digest=latest",
    "operator.watchNamespaces.Bad_NS=true",
    "operator.extraEnv.1BAD=x",
    "metrics.serviceMonitor.interval=often",
    "metrics.port=70000",
    "tolerations.spot.effect=Sometimes",
    "unknownTopLevel=1",
    "grafana.dashboards.labelValue=" + "x" * 64,
])
def test_schema_refuses_bad_values(bad: str) -> None:
    render_error(sets=[bad])
