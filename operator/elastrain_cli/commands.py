"""What each `elastrain` subcommand does; __main__ only parses arguments."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

if TYPE_CHECKING:
    from elastrain_operator.model import TrainingJob, TrainingJobSpec
    from elastrain_trainer.summary import RunSummary


class UserError(Exception):
    """A mistake in the user's input: printed without a traceback, exit code 2."""


def parse_job(text: str, origin: str, *, recovery: str | None = None) -> TrainingJob:
    """Parse and validate a TrainingJob manifest with the same rules the CRD enforces;
    `recovery` stands for spec.recovery.mode (so a job that cannot run InProcess is refused as
    the CRD would refuse it)."""
    from elastrain_operator.model import KIND, TrainingJob

    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as err:
        raise UserError(f"{origin}: not valid YAML: {err}") from err
    # A file may carry the job's Secret or ServiceAccount beside it, as kubectl apply allows.
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise UserError(f"{origin}: expected exactly one manifest of kind {KIND}, "
                        f"found {len(jobs)}")
    manifest = jobs[0]
    if recovery is not None and isinstance(manifest.get("spec"), dict):
        spec = manifest["spec"]
        spec["recovery"] = {**(spec.get("recovery") or {}), "mode": recovery}
    try:
        return TrainingJob.model_validate(manifest)
    except ValidationError as err:
        raise UserError(f"{origin}: invalid TrainingJob:\n{format_errors(err)}") from err


def format_errors(err: ValidationError) -> str:
    """One line per problem, each naming the field as a kubectl user would write it."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in e["loc"])
        path = path.replace(".[", "[")
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {path}: {message}" if path else f"  {message}")
    return "\n".join(lines)


def validate(text: str, origin: str) -> int:
    from elastrain_operator.policy.devices import device_warnings
    from elastrain_operator.policy.validation import validate as crd_rules_on_children

    job = parse_job(text, origin)
    # The CEL rules the model does not mirror (metadata.name, nprocPerNode "auto").
    if problems := crd_rules_on_children(job):
        listed = "\n".join(f"  {p}" for p in problems)
        raise UserError(f"{origin}: invalid TrainingJob:\n{listed}")
    for warning in device_warnings(job.spec):
        print(f"{origin}: warning: {warning}", file=sys.stderr)
    print(f"{origin}: TrainingJob {job.metadata.name} is valid")
    return 0


def crds() -> int:
    from elastrain_operator.render.crd import render_crd_yaml

    sys.stdout.write(render_crd_yaml())
    return 0


def _absolute_file_uri(uri: str) -> str:
    """file://./x (relative to where the user runs the command) as an absolute file:// URI."""
    if not uri.startswith("file://"):
        return uri
    return "file://" + str(Path(uri.removeprefix("file://")).expanduser().absolute())


def run_local(text: str, origin: str, *, workers: int | None, simulate_preemption: bool,
              out: str | None, checkpoint_uri: str | None, fresh: bool,
              recovery: str | None = None) -> int:
    """Run the job's trainer with torchrun agents on this machine (gloo), in the recovery mode
    the operator would run it in (spec.recovery_mode; `recovery` overrides spec.recovery.mode)."""
    from elastrain_operator.render.env import render_command
    from elastrain_trainer.launch.local import run_local as start_local
    from elastrain_trainer.launch.local import worker_entry
    from elastrain_trainer.launch.supervise import RestartBudget

    job = parse_job(text, origin, recovery=recovery)
    spec = job.spec
    try:
        # What the pods run (spec.command/args, or the built-in trainer), behind local agents.
        entry = worker_entry(render_command(spec), spec.args)
    except ValueError as err:
        raise UserError(f"{origin}: spec.command: {err}") from err
    count = workers or spec.replicas
    if not spec.min_replicas <= count <= spec.effective_max_replicas:
        raise UserError(f"--workers {count} is outside [spec.minReplicas, spec.maxReplicas]")
    # --workers is this run's spec.replicas (an InProcess world first waits for that many).
    spec = spec.model_copy(update={"replicas": count})
    out_dir = Path(out or f"runs/{job.metadata.name}").absolute()
    env = local_env(job, spec, out_dir, checkpoint_uri=checkpoint_uri, fresh=fresh)
    what = (f"{spec.strategy}, {spec.trainer.model}" if spec.command is None
            else " ".join(entry))
    print(f"elastrain: {origin}: {count} local workers (elastic {spec.min_replicas}.."
          f"{spec.effective_max_replicas}, recovery {spec.recovery_mode}), {what}, "
          f"{spec.trainer.steps} steps; checkpoints -> {env['ELASTRAIN_CHECKPOINT_URI']}",
          flush=True)
    policy = spec.restart_policy
    budget = RestartBudget(max_restarts=policy.max_restarts,
                           backoff_seconds=policy.backoff_seconds,
                           max_backoff_seconds=policy.max_backoff_seconds)
    result = start_local(env, count, spec.min_replicas, spec.effective_max_replicas, out_dir,
                         simulate_preemption=simulate_preemption, budget=budget, entry=entry,
                         cwd=_job_dir(origin) if spec.command is not None else None)
    print(f"elastrain: {result_line(result.summary, spec)}")
    print(f"elastrain: summary {result.out_dir / 'summary.json'}"
          + (f", loss curve {result.plot_path}" if result.plot_path else ""))
    if result.outcome is not None and result.outcome.failed:
        # The last line says why: a configuration error's is the trainer's own message.
        why = result.outcome.failed_reason or "MaxRestartsExceeded"
        print(f"elastrain: Failed ({why}): {result.outcome.failed}", flush=True)
    return 0 if result.ok else 1


def local_env(job: TrainingJob, spec: TrainingJobSpec, out_dir: Path, *,
              checkpoint_uri: str | None, fresh: bool) -> dict[str, str]:
    """What the operator renders for a worker pod of `spec`, as far as this machine runs it: the
    trainer's ELASTRAIN_*, and in InProcess mode the pods' standalone launcher (PET_*) and
    membership settings (the agents' store and node ids are local.py's)."""
    from elastrain_operator.render.env import (
        render_inprocess_env,
        render_standalone_torchrun_env,
        render_trainer_env,
    )

    name = job.metadata.name
    env = render_trainer_env(spec, name)
    env["ELASTRAIN_METRICS_PORT"] = "0"  # several agents share this host: no fixed port
    uri = checkpoint_uri or (spec.checkpoint.uri if spec.checkpoint else None)
    env["ELASTRAIN_CHECKPOINT_URI"] = _absolute_file_uri(uri or f"file://{out_dir}/checkpoints")
    if fresh:
        _clear_previous_run(out_dir, env["ELASTRAIN_CHECKPOINT_URI"])
        # Remote checkpoints stay: this run starts from step 0 and resumes only its own.
        env["ELASTRAIN_CHECKPOINT_RESUME"] = "never"
        env["ELASTRAIN_RUN_ID"] = f"local-{uuid.uuid4().hex[:12]}"
    if spec.in_process:
        # A pod's run id is its job's uid; a local run's is its own (--fresh), else the job's
        # name, as restart mode's torchrun run id.
        where = {"namespace": job.metadata.namespace, "job_name": name,
                 "job_uid": env.get("ELASTRAIN_RUN_ID", name)}
        env = {**render_standalone_torchrun_env(spec), **render_inprocess_env(spec, **where),
               **env}
    # spec.env as the pods get it, last (valueFrom needs a cluster: secrets and fields stay
    # unset).
    env.update({e.name: e.value for e in spec.env if e.value is not None})
    return env


def result_line(summary: RunSummary, spec: TrainingJobSpec) -> str:
    """The run's last word: how far it got and what its recoveries cost."""
    if spec.in_process:
        recovered = (f"regroups={summary.regroups} ({', '.join(summary.regroup_reasons)}) "
                     f"survivor_pause_s={summary.regroup_pauses_s} "
                     f"healed=[{', '.join(summary.heals)}]")
    else:
        recovered = f"resumes={summary.resumes}"
    return (f"finished={summary.finished} step={summary.final_step}/{spec.trainer.steps} "
            f"loss={summary.final_loss} recovery={spec.recovery_mode} {recovered} "
            f"steps_lost={summary.steps_lost} world_sizes={summary.world_sizes} "
            f"checkpoints={summary.checkpoints_saved} wall={summary.wall_s}s")


def _job_dir(origin: str) -> Path:
    """Where a command's relative paths resolve locally: beside the job file (in a pod, the
    image's working directory), or here for a job read from stdin or the built-in default."""
    path = Path(origin)
    return path.parent.absolute() if path.is_file() else Path.cwd()


def _clear_previous_run(out_dir: Path, checkpoint_uri: str) -> None:
    """--fresh: forget an earlier run's outputs and its local checkpoints (never remote ones:
    the run ignores those instead, as spec.checkpoint.resume: Never does)."""
    import shutil

    shutil.rmtree(out_dir, ignore_errors=True)
    if checkpoint_uri.startswith("file://"):
        shutil.rmtree(checkpoint_uri.removeprefix("file://"), ignore_errors=True)


def estimate(text: str, origin: str, *, world_size: int | None,
             device_memory: str | None = None) -> int:
    """Print per-rank memory for the job's trainer config at a world size; with
    `device_memory` (e.g. "80GiB"), whether it fits and, if not, which knob makes it fit.
    Exit 1 when it does not fit."""
    from elastrain_operator.render.env import render_trainer_env
    from elastrain_trainer.config import TrainerConfig
    from elastrain_trainer.estimate import estimate as estimate_memory
    from elastrain_trainer.estimate import parse_bytes, plan_fit

    job = parse_job(text, origin)
    auto_or_n = job.spec.effective_nproc_per_node
    nproc = auto_or_n if isinstance(auto_or_n, int) else max(job.spec.gpu_count, 1)
    size = world_size or job.spec.replicas * nproc
    resources = job.spec.resources
    gpu = any(k.endswith("/gpu") for k in (*resources.limits, *resources.requests))
    device = "cuda" if gpu else "cpu"
    try:
        available = None if device_memory is None else parse_bytes(device_memory)
        config = TrainerConfig.from_env(render_trainer_env(job.spec, job.metadata.name))
        print(estimate_memory(config, size, device, nproc).format())
        if available is None:
            return 0
        plan = plan_fit(config, size, available, device, nproc)
    except ValueError as err:
        raise UserError(str(err)) from err
    print(plan.format())
    return 0 if plan.fits else 1


def describe(name: str, namespace: str, kubeconfig: str | None) -> int:
    """A job's workers, budgets, losses and checkpoints, read from the cluster."""
    import os

    from elastrain_operator.describe import describe_job
    from elastrain_operator.k8s.client import Kube, KubeError, load_api_client, namespaced
    from elastrain_operator.k8s.observe import read_job
    from elastrain_operator.model.names import LABEL_JOB

    if kubeconfig:
        os.environ["KUBECONFIG"] = kubeconfig
    try:
        kube = Kube(load_api_client())
        raw = read_job(kube, namespace, name)
        if raw is None:
            raise UserError(f"TrainingJob {namespace}/{name} not found")
        pods = kube.list(namespaced("v1", namespace, "pods"), labels=f"{LABEL_JOB}={name}")
    except KubeError as err:
        raise UserError(f"the API server refused: {err}") from err
    print(describe_job(raw, pods))
    return 0


def operator(args: list[str]) -> int:
    from elastrain_operator.__main__ import main as operator_main

    result: Any = operator_main(args, prog="elastrain operator")
    return int(result or 0)
