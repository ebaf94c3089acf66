"""The TrainingJob models: defaults, aliases, and the checks that mirror the CRD's CEL rules."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from elastrain_operator.model.spec import MAX_WORKERS, TrainingJob, TrainingJobSpec
from tests.unit.operator.builders import make_job_manifest


def spec(**overrides: Any) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(make_job_manifest(**overrides)["spec"])


def test_defaults_are_filled_in() -> None:
    s = TrainingJobSpec.model_validate({"image": "img"})
    assert s.replicas == 1 and s.min_replicas == 1 and s.max_replicas is None
    assert s.strategy == "ddp"
    assert s.nproc_per_node is None and s.effective_nproc_per_node == 1
    assert s.trainer.model == "gpt-tiny" and s.trainer.precision == "fp32"
    assert s.rendezvous.port == 29400 and s.rendezvous.last_call_timeout_seconds == 1
    assert s.restart_policy.max_restarts == 3 and s.restart_policy.max_preemptions is None
    assert s.checkpoint is None and s.suspend is False
    assert s.metrics_port == 9400


def test_camel_case_round_trip() -> None:
    s = spec(trainer={"globalBatchSize": 16, "microBatchSize": 4, "lrSchedule": "wsd"},
             checkpoint={"uri": "s3://bucket/run", "async": False, "intervalSteps": 50},
             restartPolicy={"maxPreemptions": 7})
    dumped = s.to_api()
    assert dumped["trainer"]["globalBatchSize"] == 16
    assert dumped["checkpoint"] == {
        "uri": "s3://bucket/run", "intervalSteps": 50, "intervalSeconds": 600, "keep": 3,
        "async": False, "resume": "Latest"}
    assert dumped["restartPolicy"]["maxPreemptions"] == 7
    assert TrainingJobSpec.model_validate(dumped) == s


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"replicas": 0}, "replicas"),
    ({"replicas": 5}, "spec.replicas must be <= spec.maxReplicas"),
    ({"replicas": 1, "minReplicas": 2}, "spec.replicas must be >= spec.minReplicas"),
    ({"strategy": "zero3"}, "strategy"),
    ({"nprocPerNode": "all"}, "nprocPerNode"),
    ({"trainer": {"globalBatchSize": 10, "microBatchSize": 4}}, "globalBatchSize"),
    ({"trainer": {"cpuOffload": True}}, "cpuOffload requires spec.strategy fsdp"),
    ({"trainer": {"lr": 1e-4, "minLr": 1e-3}}, "minLr"),
    ({"checkpoint": {"uri": "s3:///nobucket"}}, "spec.checkpoint.uri must be"),
    ({"bogus": 1}, "bogus"),
    ({"recovery": {"mode": "InProcess"}, "command": ["torchrun", "train.py"]},
     "spec.recovery.mode InProcess needs elastrain's launcher"),
    ({"recovery": {"mode": "InProcess"}, "resources": {"limits": {"nvidia.com/gpu": 1}},
      "env": [{"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "3"}]},
     "spec.env TORCH_NCCL_ASYNC_ERROR_HANDLING (or NCCL_ASYNC_ERROR_HANDLING) must be 0 or 2"),
    ({"recovery": {"heartbeatTimeoutSeconds": 1}}, "heartbeatTimeoutSeconds"),
    ({"recovery": {"nodeLossTolerationSeconds": 3601}}, "nodeLossTolerationSeconds"),
    ({"spares": -1}, "spares"),
    ({"spares": 1, "recovery": {"mode": "Restart"}},
     "spec.spares needs spec.recovery.mode InProcess"),
    # Unset, the mode of a stock torchrun script is Restart: no spares there either.
    ({"spares": 1, "command": ["torchrun", "train.py"]},
     "spec.spares needs spec.recovery.mode InProcess"),
    ({"spares": 1, "recovery": {"mode": "InProcess"}, "metricsPort": 0},
     "spec.spares needs spec.metricsPort"),
    ({"spares": 1, "recovery": {"mode": "InProcess"}, "maxReplicas": MAX_WORKERS},
     f"spec.maxReplicas (spec.replicas when unset) + spec.spares must be <= {MAX_WORKERS}"),
])
def test_invalid_specs_fail_with_the_field_named(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        spec(**overrides)
    assert needle in str(err.value)


def test_desired_workers_is_clamped() -> None:
    assert spec(replicas=3).desired_workers == 3
    unbounded = TrainingJobSpec.model_validate({"image": "i", "replicas": 9})
    assert unbounded.effective_max_replicas == MAX_WORKERS
    assert unbounded.desired_workers == 9


def test_whole_object_parses_and_ignores_server_metadata() -> None:
    manifest = make_job_manifest()
    manifest["metadata"].update({"uid": "u-1", "generation": 3, "resourceVersion": "77",
                                 "managedFields": []})
    manifest["status"] = {"phase": "Running", "restarts": 2,
                          "conditions": [{"type": "Running", "status": "True",
                                          "reason": "WorkersRunning",
                                          "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    job = TrainingJob.model_validate(manifest)
    assert job.metadata.uid == "u-1" and job.metadata.generation == 3
    assert job.status.phase == "Running" and job.status.restarts == 2
    assert job.status.conditions[0].reason == "WorkersRunning"


def test_inprocess_accepts_several_ranks_per_pod_when_asked() -> None:
    s = spec(recovery={"mode": "InProcess"}, nprocPerNode=2)
    assert s.in_process and s.effective_nproc_per_node == 2
    assert spec(recovery={"mode": "InProcess"}, nprocPerNode=2, strategy="hsdp").in_process
    # Unset, such a job stays in the mode it got before (no running job changes protocol).
    assert spec(nprocPerNode=2).recovery_mode == "Restart"


def test_inprocess_on_gpus_is_accepted_when_asked_and_marked_experimental() -> None:
    gpu = {"limits": {"nvidia.com/gpu": 8}}
    s = spec(recovery={"mode": "InProcess"}, resources=gpu, nprocPerNode=8, strategy="hsdp",
             env=[{"name": "NCCL_ASYNC_ERROR_HANDLING", "value": "2"}])
    assert s.in_process and s.experimental is not None
    assert "experimental" in s.experimental and "not run on a GPU" in s.experimental
    # Unset, a GPU job stays in Restart, where nothing is experimental.
    assert spec(resources=gpu).recovery_mode == "Restart"
    assert spec(resources=gpu).experimental is None
    assert spec(recovery={"mode": "InProcess"}).experimental is None  # CPU: verified


def test_inprocess_accepts_the_launcher_named_in_a_command() -> None:
    s = spec(recovery={"mode": "InProcess"}, nprocPerNode=1,
             command=["python", "-m", "elastrain_trainer.launch", "train.py"])
    assert s.in_process and s.recovery.heartbeat_timeout_seconds == 5
    assert not spec(recovery={"mode": "Restart"}).in_process


@pytest.mark.parametrize(("overrides", "mode"), [
    ({}, "InProcess"),  # the built-in trainer
    ({"command": ["python", "-m", "elastrain_trainer.launch", "train.py"]}, "InProcess"),
    ({"strategy": "fsdp"}, "InProcess"),
    ({"command": ["torchrun", "train.py"]}, "Restart"),  # a stock script cannot regroup
    ({"nprocPerNode": 2}, "Restart"),
    ({"strategy": "hsdp", "nprocPerNode": 2}, "Restart"),
    ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, "Restart"),
    ({"recovery": {"mode": "Restart"}}, "Restart"),
])
def test_an_unset_mode_is_inprocess_where_the_job_can_run_it(overrides: dict[str, Any],
                                                             mode: str) -> None:
    s = spec(**overrides)
    assert s.recovery_mode == mode and s.in_process == (mode == "InProcess")
    # Unset, a job InProcess cannot run is admitted (as Restart), never refused.
    assert spec(**overrides).recovery.mode == overrides.get("recovery", {}).get("mode")


def test_inprocess_admits_fsdp() -> None:
    # FSDP2 is resharded in process (docs/recovery.md section 13, point 13).
    s = spec(recovery={"mode": "InProcess"}, strategy="fsdp")
    assert s.in_process and s.strategy == "fsdp"


def test_spares_count_against_the_bound_on_worker_pods() -> None:
    def unbounded(replicas: int, spares: int) -> TrainingJobSpec:
        return TrainingJobSpec.model_validate({"image": "i", "replicas": replicas,
                                               "spares": spares,
                                               "recovery": {"mode": "InProcess"}})
    s = unbounded(MAX_WORKERS - 2, 2)
    assert (s.desired_workers, s.spares, s.worker_pods) == (MAX_WORKERS - 2, 2, MAX_WORKERS)
    with pytest.raises(ValidationError, match=r"spec\.spares"):
        unbounded(MAX_WORKERS - 1, 2)
    bounded = spec(replicas=2, maxReplicas=MAX_WORKERS - 3, spares=3,
                   recovery={"mode": "InProcess"})
    assert bounded.worker_pods == 5
    assert spec().spares == 0 and spec().worker_pods == spec().desired_workers


def test_a_volume_named_like_the_operators_own_is_refused_naming_the_field() -> None:
    for name in ("elastrain-control", "elastrain-tmp", "elastrain-mine"):
        with pytest.raises(ValidationError, match=r"spec\.template\.volumes: a name starting "):
            TrainingJobSpec.model_validate({"image": "i", "template": {
                "volumes": [{"name": name, "emptyDir": {}}]}})
    TrainingJobSpec.model_validate({"image": "i", "template": {
        "volumes": [{"name": "my-elastrain-data", "emptyDir": {}}]}})
