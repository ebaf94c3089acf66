"""The worker environment: torchrun's PET_* and the trainer's ELASTRAIN_* contract."""

from __future__ import annotations

from typing import Any

from elastrain_operator.model.spec import TrainingJobSpec
from elastrain_operator.render.env import (
    render_command,
    render_trainer_env,
    render_worker_env,
)


def spec(**fields: Any) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({"image": "img", **fields})


def test_pet_env_points_every_worker_at_the_job_store() -> None:
    env = render_worker_env(spec(replicas=2, minReplicas=2, maxReplicas=6,
                                 rendezvous={"joinTimeoutSeconds": 900},
                                 recovery={"mode": "Restart"}),
                            namespace="ml", job_uid="uid-1", job_name="demo")
    plain = {e["name"]: e["value"] for e in env if "value" in e}
    assert {k: v for k, v in plain.items() if k.startswith(("PET_", "TORCH_"))} == {
        "PET_NNODES": "2:6",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "demo-rdzv.ml.svc:29400",
        "PET_RDZV_ID": "uid-1",
        "PET_RDZV_CONF": "is_host=false,join_timeout=900,last_call_timeout=1,"
                         "keep_alive_interval=1,keep_alive_max_attempt=3",
        "PET_MAX_RESTARTS": "1000000",
        "PET_MONITOR_INTERVAL": "0.5",
        "PET_SHUTDOWN_TIMEOUT": "115",  # the default grace (120 s) minus the margin
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def test_torchrun_lets_the_sigterm_checkpoint_use_the_pods_grace_period() -> None:
    env = render_worker_env(spec(terminationGracePeriodSeconds=600), namespace="n",
                            job_uid="u", job_name="j")
    assert {e["name"]: e.get("value") for e in env}["PET_SHUTDOWN_TIMEOUT"] == "595"


def test_unbounded_job_uses_the_crd_bound_as_max() -> None:
    env = render_worker_env(spec(nprocPerNode="auto"), namespace="n", job_uid="u", job_name="j")
    plain = {e["name"]: e.get("value") for e in env}
    assert plain["PET_NNODES"] == "1:1024" and plain["PET_NPROC_PER_NODE"] == "auto"


def test_trainer_env_is_the_documented_contract() -> None:
    env = render_trainer_env(spec(
        strategy="fsdp",
        trainer={"model": "gpt-small", "steps": 50, "lr": 1e-3, "cpuOffload": True,
                 "activationCheckpointing": False},
        checkpoint={"uri": "s3://bkt/run", "endpoint": "http://minio:9000", "intervalSteps": 5,
                    "async": False, "credentialsSecret": {"name": "creds"}, "region": "eu-1"},
        metricsPort=9500), "demo")
    assert env == {
        "ELASTRAIN_JOB_NAME": "demo", "ELASTRAIN_STRATEGY": "fsdp",
        "ELASTRAIN_MODEL": "gpt-small", "ELASTRAIN_DATASET": "synthetic",
        "ELASTRAIN_DATASET_FORMAT": "nanogpt", "ELASTRAIN_VOCAB_SIZE": "256",
        "ELASTRAIN_STEPS": "50", "ELASTRAIN_SEQ_LEN": "128",
        "ELASTRAIN_LR": "0.001", "ELASTRAIN_MIN_LR": "3e-05", "ELASTRAIN_WARMUP_STEPS": "10",
        "ELASTRAIN_LR_SCHEDULE": "cosine", "ELASTRAIN_DECAY_FRACTION": "0.2",
        "ELASTRAIN_WEIGHT_DECAY": "0.1", "ELASTRAIN_PRECISION": "fp32",
        "ELASTRAIN_ACTIVATION_CHECKPOINTING": "0", "ELASTRAIN_CPU_OFFLOAD": "1",
        "ELASTRAIN_MAX_GRAD_NORM": "1.0", "ELASTRAIN_SPIKE_FACTOR": "0.0",
        "ELASTRAIN_SEED": "1234",
        "ELASTRAIN_CHECKPOINT_URI": "s3://bkt/run",
        "ELASTRAIN_CHECKPOINT_ENDPOINT": "http://minio:9000",
        "ELASTRAIN_CHECKPOINT_INTERVAL_STEPS": "5",
        "ELASTRAIN_CHECKPOINT_INTERVAL_SECONDS": "600", "ELASTRAIN_CHECKPOINT_KEEP": "3",
        "ELASTRAIN_CHECKPOINT_ASYNC": "0", "ELASTRAIN_METRICS_PORT": "9500",
    }


def test_no_checkpoint_block_means_no_checkpoint_env() -> None:
    env = render_trainer_env(spec(), "demo")
    assert not [k for k in env if k.startswith("ELASTRAIN_CHECKPOINT")]
    assert not [k for k in env if k.startswith(("PET_", "AWS_"))]


def test_credentials_come_from_the_secret_and_user_env_goes_last() -> None:
    env = render_worker_env(spec(
        checkpoint={"uri": "s3://bkt/run", "region": "eu-1",
                    "credentialsSecret": {"name": "creds", "accessKeyIdKey": "id"}},
        env=[{"name": "ELASTRAIN_STEPS", "value": "7"},
             {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
        namespace="n", job_uid="u", job_name="j")
    names = [e["name"] for e in env]
    assert env[names.index("AWS_ACCESS_KEY_ID")] == {
        "name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "id"}}}
    assert env[names.index("AWS_SECRET_ACCESS_KEY")]["valueFrom"]["secretKeyRef"] == {
        "name": "creds", "key": "AWS_SECRET_ACCESS_KEY"}
    assert {"name": "AWS_REGION", "value": "eu-1"} in env
    assert env[-2:] == [{"name": "ELASTRAIN_STEPS", "value": "7"},
                        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    assert names.index("PET_NNODES") < names.index("ELASTRAIN_JOB_NAME") < names.index(
        "AWS_ACCESS_KEY_ID")


def test_default_command_runs_the_builtin_trainer_under_torchrun() -> None:
    assert render_command(spec()) == ["python", "-m", "elastrain_trainer.launch", "-m",
                                      "elastrain_trainer"]
    assert render_command(spec(command=["python", "train.py"])) == ["python", "train.py"]


def test_a_token_file_dataset_passes_through_with_its_format_and_vocabulary() -> None:
    env = render_trainer_env(spec(trainer={"dataset": "s3://corpus/fineweb/train_000.bin",
                                           "datasetFormat": "llmc", "vocabSize": 50304}), "j")
    assert (env["ELASTRAIN_DATASET"], env["ELASTRAIN_DATASET_FORMAT"],
            env["ELASTRAIN_VOCAB_SIZE"]) == ("s3://corpus/fineweb/train_000.bin", "llmc", "50304")


def test_checkpoint_resume_never_reaches_the_trainer_and_latest_renders_nothing() -> None:
    never = render_trainer_env(spec(checkpoint={"uri": "s3://bucket/p", "resume": "Never"}), "j")
    assert never["ELASTRAIN_CHECKPOINT_RESUME"] == "never"
    latest = render_trainer_env(spec(checkpoint={"uri": "s3://bucket/p"}), "j")
    assert "ELASTRAIN_CHECKPOINT_RESUME" not in latest  # the trainer's default


def test_inprocess_workers_run_torchrun_standalone_and_join_the_job_store() -> None:
    env = render_worker_env(spec(replicas=3, minReplicas=2, maxReplicas=4,
                                 recovery={"mode": "InProcess", "heartbeatTimeoutSeconds": 3}),
                            namespace="ml", job_uid="uid-1", job_name="demo")
    plain = {e["name"]: e["value"] for e in env if "value" in e}
    # No cross-pod rendezvous: torchrun never restarts a worker group for a membership change.
    assert {k: v for k, v in plain.items() if k.startswith(("PET_", "TORCH_"))} == {
        "PET_STANDALONE": "1",
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "1",
        "PET_MAX_RESTARTS": "1000000",
        "PET_MONITOR_INTERVAL": "0.5",
        "PET_SHUTDOWN_TIMEOUT": "115",
    }
    assert {k: v for k, v in plain.items()
            if k in {"ELASTRAIN_RECOVERY", "ELASTRAIN_STORE", "ELASTRAIN_RUN_ID",
                     "ELASTRAIN_REPLICAS", "ELASTRAIN_MAX_REPLICAS", "ELASTRAIN_MIN_REPLICAS",
                     "ELASTRAIN_SPARES", "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS"}} == {
        "ELASTRAIN_RECOVERY": "inProcess",
        "ELASTRAIN_STORE": "demo-rdzv.ml.svc:29400",
        "ELASTRAIN_RUN_ID": "uid-1",
        "ELASTRAIN_REPLICAS": "3",
        "ELASTRAIN_MAX_REPLICAS": "4",
        "ELASTRAIN_MIN_REPLICAS": "2",
        "ELASTRAIN_SPARES": "0",
        "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": "3",
    }
    node_id = [e for e in env if e["name"] == "ELASTRAIN_NODE_ID"]
    assert node_id == [{"name": "ELASTRAIN_NODE_ID",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]


def test_spares_reach_the_trainers_and_the_world_stays_the_desired_one() -> None:
    env = render_worker_env(spec(replicas=3, maxReplicas=4, spares=2,
                                 recovery={"mode": "InProcess"}),
                            namespace="ml", job_uid="uid-1", job_name="demo")
    plain = {e["name"]: e["value"] for e in env if "value" in e}
    assert (plain["ELASTRAIN_SPARES"], plain["ELASTRAIN_REPLICAS"],
            plain["ELASTRAIN_MAX_REPLICAS"]) == ("2", "3", "4")


INPROCESS_SETTINGS = {"ELASTRAIN_RECOVERY", "ELASTRAIN_STORE", "ELASTRAIN_NODE_ID",
                      "ELASTRAIN_SPARES", "PET_STANDALONE"}


def env_names(s: TrainingJobSpec) -> set[str]:
    return {e["name"] for e in render_worker_env(s, namespace="n", job_uid="u", job_name="j")}


def test_restart_mode_renders_no_inprocess_setting() -> None:
    # Set, or unset for a stock torchrun script (which cannot regroup in process).
    for restart in (spec(recovery={"mode": "Restart"}), spec(command=["torchrun", "t.py"])):
        assert not env_names(restart) & INPROCESS_SETTINGS
    # Unset for the built-in trainer: InProcess.
    assert {"ELASTRAIN_RECOVERY", "ELASTRAIN_STORE", "PET_STANDALONE"} <= env_names(spec())


def test_restart_mode_workers_know_their_pod_name() -> None:
    """A worker's HOSTNAME is its slot's stable hostname; its dark-peer watch marks a pod by
    its name (trainer session.dark_peers), which only the downward API gives."""
    env = render_worker_env(spec(recovery={"mode": "Restart"}), namespace="n", job_uid="u",
                            job_name="j")
    assert [e for e in env if e["name"] == "ELASTRAIN_POD_NAME"] == [
        {"name": "ELASTRAIN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    assert "ELASTRAIN_POD_NAME" not in env_names(spec(recovery={"mode": "InProcess"}))


def test_inprocess_node_id_from_the_user_wins() -> None:
    env = render_worker_env(spec(recovery={"mode": "InProcess"},
                                 env=[{"name": "ELASTRAIN_NODE_ID", "value": "mine"}]),
                            namespace="n", job_uid="u", job_name="j")
    assert [e for e in env if e["name"] == "ELASTRAIN_NODE_ID"] == [
        {"name": "ELASTRAIN_NODE_ID", "value": "mine"}]


def test_the_batch_reaches_the_trainer_only_where_the_spec_sets_it() -> None:
    """Unset, a user script's DataLoader decides its batch (and the built-in trainer uses its
    own 8 and 2); set, the script's Session checks its loader against it."""
    unset = render_trainer_env(TrainingJobSpec.model_validate({"image": "t"}), "demo")
    assert not {"ELASTRAIN_GLOBAL_BATCH_SIZE", "ELASTRAIN_MICRO_BATCH_SIZE"} & set(unset)
    one = render_trainer_env(TrainingJobSpec.model_validate(
        {"image": "t", "trainer": {"globalBatchSize": 12}}), "demo")
    assert one["ELASTRAIN_GLOBAL_BATCH_SIZE"] == "12" and "ELASTRAIN_MICRO_BATCH_SIZE" not in one
