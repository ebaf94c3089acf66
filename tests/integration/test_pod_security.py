"""Pod Security on a real kube-apiserver: the built-in PodSecurity admission judges the pods the
operator renders in a namespace labelled `enforce: restricted`, the CRD refuses a job that
loosens its pods without naming the level, and the chart's admission policy warns when it does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.rendezvous import render_store_pod
from elastrain_operator.render.workers import render_worker_pod
from tests.integration.conftest import kubectl
from tests.unit.chart.chartlib import CHART
from tests.unit.operator.builders import make_job_manifest
from tests.unit.operator.test_render_security import LOOSE

pytestmark = pytest.mark.cluster

POLICY_FILE = CHART / "files" / "pod-security-warnings.yaml"


@pytest.fixture
def restricted(crd: Any, kube_namespace: str) -> str:
    """The test's namespace, enforcing (and warning at) the restricted level."""
    kubectl(crd, "label", "namespace", kube_namespace, "--overwrite",
            "pod-security.kubernetes.io/enforce=restricted",
            "pod-security.kubernetes.io/warn=restricted")
    return kube_namespace


def dry_run_pod(kube: Any, namespace: str, pod: dict[str, Any]) -> tuple[int, str]:
    """`kubectl create --dry-run=server`: every admission plugin runs, nothing is stored."""
    pod = json.loads(json.dumps(pod))
    pod["metadata"].pop("ownerReferences", None)  # the job does not exist here
    pod["metadata"]["namespace"] = namespace
    done = kubectl(kube, "create", "--dry-run=server", "-o", "name", "-f", "-",
                   input_text=json.dumps(pod), check=False)
    return done.returncode, done.stdout + done.stderr


def job(namespace: str, **spec: Any) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": "sec", "namespace": namespace, "uid": "u"},
        "spec": {"image": "trainer:dev", **spec}})


ADMITTED = {
    "defaults": {},
    "gpu": {"resources": {"limits": {"nvidia.com/gpu": 4, "memory": "64Gi"}},
            "strategy": "fsdp", "trainer": {"precision": "bf16"}},
    "own-user-fsgroup-writable-root": {
        "template": {"podSecurityContext": {"runAsUser": 1000, "runAsGroup": 1000,
                                            "fsGroup": 1000},
                     "securityContext": {"readOnlyRootFilesystem": False,
                                         "capabilities": {"add": ["NET_BIND_SERVICE"]}},
                     "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}]}},
    "stock-torchrun": {"command": ["torchrun", "train.py"]},
    # The pod name through the downward API, torchrun standalone.
    "inprocess": {"recovery": {"mode": "InProcess"}},
}


@pytest.mark.parametrize("spec", ADMITTED.values(), ids=ADMITTED)
def test_rendered_pods_pass_restricted_as_they_are(crd: Any, restricted: str,
                                                   spec: dict[str, Any]) -> None:
    tj = job(restricted, **spec)
    for pod in (render_worker_pod(tj, 0, 0), render_store_pod(tj)):
        rc, out = dry_run_pod(crd, restricted, pod)
        assert rc == 0 and "Warning" not in out, out


def test_the_namespace_refuses_what_restricted_forbids(crd: Any, restricted: str) -> None:
    # The label bites: an unhardened pod, and a job's pod loosened (as Baseline allows), are
    # refused by the apiserver itself, naming what is wrong.
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bare"},
            "spec": {"containers": [{"name": "c", "image": "trainer:dev"}]}}
    rc, out = dry_run_pod(crd, restricted, bare)
    assert rc != 0 and 'violates PodSecurity "restricted:latest"' in out, out
    loose = job(restricted, template={"podSecurity": "Baseline",
                                      "securityContext": {"allowPrivilegeEscalation": True}})
    rc, out = dry_run_pod(crd, restricted, render_worker_pod(loose, 0, 0))
    assert rc != 0 and "allowPrivilegeEscalation != false" in out, out


def apply_job(kube: Any, namespace: str, name: str, template: dict[str, Any]) -> tuple[int, str]:
    manifest = make_job_manifest(name, template=template)
    done = kubectl(kube, "apply", "-n", namespace, "-f", "-",
                   input_text=json.dumps(manifest), check=False)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize(("template", "field", "level"), LOOSE,
                         ids=[f"{f}-{lv}" for _, f, lv in LOOSE])
def test_a_loosening_is_refused_unless_its_level_is_named(
        crd: Any, kube_namespace: str, template: dict[str, Any], field: str,
        level: str) -> None:
    rc, out = apply_job(crd, kube_namespace, "loose", template)
    assert rc != 0, out
    assert (f"spec.template.{field}: the pods would" in out
            and f"set spec.template.podSecurity: {level} to allow it" in out), out
    rc, out = apply_job(crd, kube_namespace, "loose", {**template, "podSecurity": level})
    assert rc == 0, out


@pytest.fixture
def warnings_policy(crd: Any) -> Iterator[Any]:
    kubectl(crd, "apply", "-f", str(POLICY_FILE))
    yield crd
    kubectl(crd, "delete", "-f", str(POLICY_FILE), "--wait=false", check=False)


def test_admission_warns_with_what_was_loosened(warnings_policy: Any,
                                                kube_namespace: str) -> None:
    kube = warnings_policy
    loose = {"podSecurity": "Baseline", "podSecurityContext": {"runAsUser": 0},
             "securityContext": {"allowPrivilegeEscalation": True,
                                 "readOnlyRootFilesystem": False}}
    # The apiserver loads a new policy within a second or two: apply until it speaks.
    deadline, attempt, out = time.monotonic() + 30, 0, ""
    while "Warning:" not in out and time.monotonic() < deadline:
        attempt += 1
        rc, out = apply_job(kube, kube_namespace, f"warned-{attempt}", loose)
        assert rc == 0, out
        time.sleep(0.5)
    warnings = [line for line in out.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 3, out
    assert any("spec.template.podSecurityContext.runAsUser: the job's pods may run as root"
               in w for w in warnings), out
    assert any("spec.template.securityContext.allowPrivilegeEscalation" in w
               for w in warnings), out
    assert any("readOnlyRootFilesystem: false" in w for w in warnings), out
    # A job within restricted hears nothing.
    rc, out = apply_job(kube, kube_namespace, "quiet", {"podSecurityContext": {"fsGroup": 5}})
    assert rc == 0 and "Warning" not in out, out

