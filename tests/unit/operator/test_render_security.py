"""Pod security, scratch volumes and GPU settings of the rendered pods (pure; the real
apiserver's PodSecurity admission judges the same pods in tests/integration/test_pod_security.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from elastrain_operator.model.pod_security import LOOSENINGS, loosened
from elastrain_operator.model.spec import GPU_REQUESTS_MESSAGE, TrainingJob
from elastrain_operator.policy.devices import device_warnings
from elastrain_operator.render.admission import render_pod_security_warnings_yaml
from elastrain_operator.render.env import NCCL_ENV
from elastrain_operator.render.rendezvous import render_store_pod
from elastrain_operator.render.workers import render_worker_pod
from tests.unit.chart.chartlib import CHART


def job(**spec: Any) -> TrainingJob:
    return TrainingJob.model_validate({
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1"},
        "spec": {"image": "trainer:dev", **spec}})


def worker(**spec: Any) -> dict[str, Any]:
    return render_worker_pod(job(**spec), 0, 0)


def container(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(pod)["env"]}


RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                  "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]}}


def test_every_pod_is_restricted_with_no_input() -> None:
    for pod in (worker(), render_store_pod(job())):
        assert pod["spec"]["securityContext"] == RESTRICTED_POD
        assert container(pod)["securityContext"] == RESTRICTED_CONTAINER
        # A read-only root filesystem, and /tmp writable for torchrun and tempfile.
        assert {"name": "elastrain-tmp", "mountPath": "/tmp"} in container(pod)["volumeMounts"]
        assert {"name": "elastrain-tmp", "emptyDir": {}} in pod["spec"]["volumes"]


def test_the_job_may_tighten_or_change_the_user_within_restricted() -> None:
    pod = worker(template={
        "podSecurityContext": {"runAsUser": 1000, "fsGroup": 2000,
                               "fsGroupChangePolicy": "OnRootMismatch",
                               "seccompProfile": {"type": "Localhost",
                                                  "localhostProfile": "profiles/train.json"}},
        "securityContext": {"readOnlyRootFilesystem": False,
                            "capabilities": {"add": ["NET_BIND_SERVICE"]}}})
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 65532, "fsGroup": 2000,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/train.json"}}
    assert container(pod)["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}
    # The store runs the operator's program: the job's container settings do not reach it.
    store = render_store_pod(job(template={"securityContext": {"privileged": True},
                                           "podSecurity": "Privileged"}))
    assert container(store)["securityContext"] == RESTRICTED_CONTAINER


# (template, the loosening's field, the level it needs)
LOOSE: list[tuple[dict[str, Any], str, str]] = [
    ({"podSecurityContext": {"runAsNonRoot": False}}, "podSecurityContext.runAsNonRoot",
     "Baseline"),
    ({"podSecurityContext": {"runAsUser": 0}}, "podSecurityContext.runAsUser", "Baseline"),
    ({"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}},
     "podSecurityContext.seccompProfile", "Privileged"),
    ({"securityContext": {"allowPrivilegeEscalation": True}},
     "securityContext.allowPrivilegeEscalation", "Baseline"),
    ({"securityContext": {"privileged": True}}, "securityContext.privileged", "Privileged"),
    ({"securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}},
     "securityContext.capabilities.add", "Privileged"),
    ({"securityContext": {"capabilities": {"add": ["CHOWN"]}}},
     "securityContext.capabilities.add", "Baseline"),
    ({"volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}, "volumes", "Baseline"),
    ({"volumes": [{"name": "h", "hostPath": {"path": "/data"}}]}, "volumes", "Privileged"),
]


@pytest.mark.parametrize(("template", "field", "level"), LOOSE,
                         ids=[f"{f}-{lv}" for _, f, lv in LOOSE])
def test_a_loosening_needs_its_level_named(template: dict[str, Any], field: str,
                                           level: str) -> None:
    with pytest.raises(ValidationError) as refused:
        job(template=template)
    assert (f"spec.template.{field}: the pods would" in str(refused.value)
            and f"set spec.template.podSecurity: {level} to allow it" in str(refused.value))
    if level == "Privileged":  # Baseline is not enough for it
        with pytest.raises(ValidationError):
            job(template={**template, "podSecurity": "Baseline"})
    allowed = job(template={**template, "podSecurity": level})
    assert any(p.startswith(f"spec.template.{field} (") for p in loosened(allowed.spec.template))


def test_a_loosening_reaches_the_pod() -> None:
    pod = worker(template={"podSecurity": "Baseline",
                           "podSecurityContext": {"runAsUser": 0},
                           "securityContext": {"allowPrivilegeEscalation": True,
                                               "capabilities": {"add": ["SYS_CHROOT"]}}})
    assert pod["spec"]["securityContext"]["runAsUser"] == 0
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is False
    assert container(pod)["securityContext"]["allowPrivilegeEscalation"] is True
    assert container(pod)["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                                 "add": ["SYS_CHROOT"]}


def test_restricted_volume_types_need_nothing() -> None:
    t = job(template={"volumes": [{"name": "c", "configMap": {"name": "x"}},
                                  {"name": "p", "persistentVolumeClaim": {"claimName": "d"}}]})
    assert loosened(t.spec.template) == []


def test_shm_is_memory_backed_and_scales_with_local_processes() -> None:
    def shm(pod: dict[str, Any]) -> dict[str, Any] | None:
        return next((v for v in pod["spec"]["volumes"] if v["name"] == "elastrain-shm"), None)

    assert shm(worker()) == {"name": "elastrain-shm",
                             "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    assert shm(worker(nprocPerNode=4))["emptyDir"]["sizeLimit"] == "4Gi"
    assert shm(worker(resources={"limits": {"nvidia.com/gpu": 8}}))["emptyDir"]["sizeLimit"] \
        == "8Gi"
    assert shm(worker(template={"shmSize": "16Gi"}))["emptyDir"]["sizeLimit"] == "16Gi"
    off = worker(template={"shmSize": "0"})
    assert shm(off) is None
    assert all(m["mountPath"] != "/dev/shm" for m in container(off)["volumeMounts"])
    # The store gets no /dev/shm: it runs a TCPStore.
    assert shm(render_store_pod(job())) is None


def test_a_users_own_mount_at_a_scratch_path_wins() -> None:
    pod = worker(template={"volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "50Gi"}}],
                           "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]})
    mounts = [m["mountPath"] for m in container(pod)["volumeMounts"]]
    assert mounts.count("/tmp") == 1 and "/dev/shm" in mounts
    assert "elastrain-tmp" not in [v["name"] for v in pod["spec"]["volumes"]]


@pytest.mark.parametrize("resources", [{"limits": {"nvidia.com/gpu": 4}},
                                       {"requests": {"nvidia.com/gpu": 4}},
                                       {"limits": {"nvidia.com/gpu": 4, "memory": "64Gi"},
                                        "requests": {"nvidia.com/gpu": 4, "cpu": "8"}}])
def test_a_gpu_job_is_ready_for_gpus(resources: dict[str, Any]) -> None:
    pod = worker(resources=resources)
    res = container(pod)["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 4
    env = env_of(pod)
    assert env["PET_NPROC_PER_NODE"] == "4"  # one rank per GPU, nprocPerNode unset
    assert all(env[k] == v for k, v in NCCL_ENV.items())
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in pod["spec"]["tolerations"]


def test_cpu_jobs_get_no_gpu_settings_and_user_settings_win() -> None:
    cpu = worker(resources={"limits": {"cpu": "2"}})
    assert not any(t["key"].endswith("/gpu") for t in cpu["spec"]["tolerations"])
    assert not set(NCCL_ENV) & set(env_of(cpu))
    assert env_of(cpu)["PET_NPROC_PER_NODE"] == "1"
    gpu = worker(resources={"limits": {"nvidia.com/gpu": 2}}, nprocPerNode=1,
                 env=[{"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "3"}],
                 template={"tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal",
                                            "value": "present", "effect": "NoSchedule"}]})
    env = [e for e in container(gpu)["env"] if e["name"] == "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert env == [{"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "3"}]
    assert env_of(gpu)["PET_NPROC_PER_NODE"] == "1"
    gpu_tolerations = [t for t in gpu["spec"]["tolerations"] if t["key"].endswith("/gpu")]
    assert len(gpu_tolerations) == 1  # theirs, not a second one of ours


def test_unequal_gpu_requests_and_limits_are_refused() -> None:
    with pytest.raises(ValidationError, match=GPU_REQUESTS_MESSAGE.split(":")[0]):
        job(resources={"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 1}})


@pytest.mark.parametrize(("spec", "says"), [
    ({"trainer": {"precision": "fp16"}}, "fp16 on CPU workers"),
    ({"strategy": "fsdp", "trainer": {"cpuOffload": True}}, "cpuOffload has no effect"),
    ({"resources": {"limits": {"nvidia.com/gpu": 2}}, "nprocPerNode": 4}, "refuses two ranks"),
    ({"resources": {"limits": {"nvidia.com/gpu": 8}}, "nprocPerNode": 2}, "6 of the pod's 8"),
    ({"resources": {"limits": {"nvidia.com/gpu": 8}}, "template": {"shmSize": 0}}, "bus errors"),
])
def test_device_warnings(spec: dict[str, Any], says: str) -> None:
    warnings = device_warnings(job(**spec).spec)
    assert len(warnings) == 1 and says in warnings[0]


def test_sound_jobs_get_no_device_warning() -> None:
    for spec in ({}, {"trainer": {"precision": "bf16"}},
                 {"resources": {"limits": {"nvidia.com/gpu": 8}},
                  "trainer": {"precision": "fp16"}}):
        assert device_warnings(job(**spec).spec) == []


def test_the_chart_carries_the_generated_admission_warnings() -> None:
    text = (CHART / "files" / "pod-security-warnings.yaml").read_text()
    assert text == render_pod_security_warnings_yaml(), "run `make crds`"
    policy = yaml.safe_load(text)["items"][0]
    messages = [v["message"] for v in policy["spec"]["validations"]]
    assert all(any(x.field in m for m in messages) for x in LOOSENINGS)
