"""The worker container's environment: torchrun's PET_* options and the trainer's ELASTRAIN_*.

torchrun reads every option's default from PET_<OPTION>, so a stock `torchrun train.py` image
runs unchanged. The rendezvous endpoint is the job's own store (never a worker: `is_host=false`),
and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes each round's rank 0 publish a fresh master
address (without it a scale-up hangs; see docs on rendezvous). torchrun's own restart budget is
set high because the job's failure budget lives in the operator. With spec.recovery.mode
InProcess torchrun runs standalone in each pod instead, and the trainer's Session forms the job's
world over the same store (render_inprocess_env).

Order matters: PET_*/TORCH_*, then ELASTRAIN_*, then credentials, then the user's spec.env last,
so a user can override anything (Kubernetes lets the later duplicate win).
"""

from __future__ import annotations

from typing import Any

from elastrain_operator.model.names import store_host
from elastrain_operator.model.spec import TrainingJobSpec
from elastrain_operator.render.control import TOKEN_FILE, TOKEN_FILE_ENV

# torchrun with worker-group restarts that wait as long as stops (elastrain_trainer.launch).
DEFAULT_COMMAND = ("python", "-m", "elastrain_trainer.launch", "-m", "elastrain_trainer")
TORCHRUN_MAX_RESTARTS = 1_000_000
MONITOR_INTERVAL_SECONDS = 0.5
# torchrun SIGKILLs its workers this long before the kubelet would SIGKILL the pod, so that it
# still exits (and reports) on its own.
SHUTDOWN_MARGIN_SECONDS = 5

EnvList = list[dict[str, Any]]
NODE_ID_ENV = "ELASTRAIN_NODE_ID"
# Restart mode: the pod's name (its HOSTNAME is the stable `<job>-worker-<index>`, the same for
# each attempt), which the dark-peer watch marks for the operator (trainer session.dark_peers).
POD_NAME_ENV = "ELASTRAIN_POD_NAME"


def _text(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def render_rendezvous_conf(spec: TrainingJobSpec) -> str:
    r = spec.rendezvous
    return ",".join([
        "is_host=false",
        f"join_timeout={r.join_timeout_seconds}",
        f"last_call_timeout={r.last_call_timeout_seconds}",
        f"keep_alive_interval={r.keep_alive_interval_seconds}",
        f"keep_alive_max_attempt={r.keep_alive_max_attempts}",
    ])


def render_torchrun_env(spec: TrainingJobSpec, *, namespace: str, job_uid: str,
                        job_name: str) -> dict[str, str]:
    """PET_* for an elastic c10d run against the job's rendezvous store."""
    return {
        "PET_NNODES": f"{spec.min_replicas}:{spec.effective_max_replicas}",
        "PET_NPROC_PER_NODE": str(spec.effective_nproc_per_node),
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"{store_host(job_name, namespace)}:{spec.rendezvous.port}",
        "PET_RDZV_ID": job_uid,
        "PET_RDZV_CONF": render_rendezvous_conf(spec),
        **_agent_env(spec),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # The workers' dark-peer watch (elastrain_trainer.session.dark_peers).
        "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": str(spec.recovery.heartbeat_timeout_seconds),
    }


def _agent_env(spec: TrainingJobSpec) -> dict[str, str]:
    """The torchrun agent's own settings, the same in both recovery modes."""
    return {
        "PET_MAX_RESTARTS": str(TORCHRUN_MAX_RESTARTS),
        "PET_MONITOR_INTERVAL": str(MONITOR_INTERVAL_SECONDS),
        # How long a SIGTERMed torchrun lets its workers save before SIGKILL (default 30 s): the
        # pod's grace period, not torchrun's default, bounds the SIGTERM checkpoint.
        "PET_SHUTDOWN_TIMEOUT": str(max(1, spec.termination_grace_period_seconds
                                        - SHUTDOWN_MARGIN_SECONDS)),
    }


def render_standalone_torchrun_env(spec: TrainingJobSpec) -> dict[str, str]:
    """PET_* for recovery InProcess: torchrun only starts and watches this pod's own rank.

    With no cross-pod rendezvous, no membership change anywhere restarts a worker group: the
    Session regroups the job's ranks in process over the job's store (ELASTRAIN_STORE). A rank
    that exits for a lost peer is restarted in place, in this pod, and rejoins the live job; a
    crash still ends the agent (the launcher's crash budget).
    """
    return {
        "PET_STANDALONE": "1",
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": str(spec.effective_nproc_per_node),
        **_agent_env(spec),
    }


def render_inprocess_env(spec: TrainingJobSpec, *, namespace: str, job_uid: str,
                         job_name: str) -> dict[str, str]:
    """The Session's in-process membership settings (elastrain_trainer.inprocess.config);
    ELASTRAIN_NODE_ID, the pod's name, comes from the downward API (render_worker_env)."""
    return {
        "ELASTRAIN_RECOVERY": "inProcess",
        "ELASTRAIN_STORE": f"{store_host(job_name, namespace)}:{spec.rendezvous.port}",
        "ELASTRAIN_RUN_ID": job_uid,
        # What the first generation waits for; a pod created after a scale-up carries the new
        # value, so the bound on the world is the job's constant maximum below.
        "ELASTRAIN_REPLICAS": str(spec.desired_workers),
        "ELASTRAIN_MAX_REPLICAS": str(spec.effective_max_replicas),
        "ELASTRAIN_MIN_REPLICAS": str(spec.min_replicas),
        # With spares the world is the desired one (ELASTRAIN_REPLICAS until the operator's
        # POST /control says otherwise); the nodes beyond it wait as spares.
        "ELASTRAIN_SPARES": str(spec.spares),
        TOKEN_FILE_ENV: TOKEN_FILE,  # the job's control token (render/control.py)
        "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": str(spec.recovery.heartbeat_timeout_seconds),
    }


def render_trainer_env(spec: TrainingJobSpec, job_name: str) -> dict[str, str]:
    """The built-in trainer's ELASTRAIN_* contract (no PET_*, no secrets); also used locally.

    trainer.fooBar -> ELASTRAIN_FOO_BAR, trainer.validation.fooBar ->
    ELASTRAIN_VALIDATION_FOO_BAR, checkpoint.fooBar -> ELASTRAIN_CHECKPOINT_FOO_BAR.
    """
    env = {"ELASTRAIN_JOB_NAME": job_name, "ELASTRAIN_STRATEGY": spec.strategy}
    for name, value in spec.trainer.model_dump(exclude={"validation"}).items():
        if value is not None:  # unset: the trainer's default, or a script's own choice
            env[f"ELASTRAIN_{name.upper()}"] = _text(value)
    validation = spec.trainer.validation
    if validation is not None:  # trainer.validation.fooBar -> ELASTRAIN_VALIDATION_FOO_BAR
        for name, value in validation.model_dump().items():
            env[f"ELASTRAIN_VALIDATION_{name.upper()}"] = _text(value)
    ckpt = spec.checkpoint
    if ckpt is not None:
        env["ELASTRAIN_CHECKPOINT_URI"] = ckpt.uri
        if ckpt.endpoint:
            env["ELASTRAIN_CHECKPOINT_ENDPOINT"] = ckpt.endpoint
        env["ELASTRAIN_CHECKPOINT_INTERVAL_STEPS"] = _text(ckpt.interval_steps)
        env["ELASTRAIN_CHECKPOINT_INTERVAL_SECONDS"] = _text(ckpt.interval_seconds)
        env["ELASTRAIN_CHECKPOINT_KEEP"] = _text(ckpt.keep)
        env["ELASTRAIN_CHECKPOINT_ASYNC"] = _text(ckpt.async_)
        if ckpt.resume != "Latest":  # the trainer's default: existing jobs' pods stay the same
            env["ELASTRAIN_CHECKPOINT_RESUME"] = ckpt.resume.lower()
    env["ELASTRAIN_METRICS_PORT"] = _text(spec.metrics_port)
    return env


def _credentials(spec: TrainingJobSpec) -> EnvList:
    ckpt = spec.checkpoint
    if ckpt is None:
        return []
    out: EnvList = []
    if ckpt.credentials_secret is not None:
        ref = ckpt.credentials_secret
        out += [
            {"name": "AWS_ACCESS_KEY_ID",
             "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.access_key_id_key}}},
            {"name": "AWS_SECRET_ACCESS_KEY",
             "valueFrom": {"secretKeyRef": {"name": ref.name,
                                            "key": ref.secret_access_key_key}}},
        ]
    if ckpt.region:
        out.append({"name": "AWS_REGION", "value": ckpt.region})
    return out


# On GPU workers (the trainer then runs NCCL for the model's collectives): 1 makes a failed or
# timed-out collective abort its communicator and end the process, so torchrun and the operator
# see a failure instead of a rank hung on a dead peer (torch's default, 3, skips the abort and
# can hang at exit); the flight recorder's dump on timeout says which collective and rank hung
# (written under /tmp, an emptyDir).
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
}


def render_worker_env(spec: TrainingJobSpec, *, namespace: str, job_uid: str,
                      job_name: str) -> EnvList:
    """The full env list of a worker container, in the order documented above."""
    where = {"namespace": namespace, "job_uid": job_uid, "job_name": job_name}
    if spec.in_process:
        launch = {**render_standalone_torchrun_env(spec), **render_inprocess_env(spec, **where)}
    else:
        launch = render_torchrun_env(spec, **where)
    plain = {**launch, **render_trainer_env(spec, job_name),
             **(NCCL_ENV if spec.gpu_count else {})}
    own = {e.name for e in spec.env}
    # The user's spec.env comes last and wins; a setting of ours they also set is left out
    # rather than shadowed (two entries of one name: kubectl warns, readers are misled).
    env: EnvList = [{"name": k, "value": v} for k, v in plain.items() if k not in own]
    if spec.in_process and NODE_ID_ENV not in own:
        # Unique per pod attempt: a replacement is a new member, never the lost one back.
        env.append({"name": NODE_ID_ENV,
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    elif not spec.in_process and POD_NAME_ENV not in own:
        env.append({"name": POD_NAME_ENV,
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    env += _credentials(spec)
    env += [e.to_api() for e in spec.env]
    return env


def render_command(spec: TrainingJobSpec) -> list[str]:
    return list(spec.command) if spec.command is not None else list(DEFAULT_COMMAND)
