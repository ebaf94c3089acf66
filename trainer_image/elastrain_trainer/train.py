"""The training loop: build, resume, step, checkpoint, and stop on agreement.

Exit codes: 0 when training finished or this rank was SIGTERMed (after saving);
EXIT_RESTART (75) when another rank was SIGTERMed, so torchrun restarts this group.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastrain_trainer import fault_injection, metrics
from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest, open_storage
from elastrain_trainer.checkpoint.precheck import ensure_checkpoint_location
from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.data import Dataset, build_dataset, make_batch, micro_batch_indices
from elastrain_trainer.estimate import (
    available_host_bytes,
    check_fits,
    estimate,
    measure_peak,
    return_freed_host_memory,
)
from elastrain_trainer.events import emit
from elastrain_trainer.guard import SpikeGuard
from elastrain_trainer.model import build_model, lm_loss
from elastrain_trainer.parallel import (
    DistEnv,
    autocast,
    gradient_sync,
    init_distributed,
    read_dist_env,
    wrap_model,
)
from elastrain_trainer.schedule import Schedule, build_scheduler
from elastrain_trainer.signals import StopAgreement
from elastrain_trainer.state import (
    Progress,
    TrainObjects,
    apply_app_state,
    build_app_state,
    step_seed,
)


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    skipped: str | None


def should_checkpoint(step: int, interval_steps: int, time_due: bool) -> bool:
    """Save after this step? (step-based locally; time-based already agreed by all ranks)."""
    return time_due or (interval_steps > 0 and step % interval_steps == 0)


def run(cfg: TrainerConfig) -> int:
    """Train per `cfg` inside the current torchrun worker; returns the exit code."""
    started = time.monotonic()
    denv = read_dist_env(os.environ)
    groups = init_distributed(denv)
    control_pg = groups.control
    world = dist.get_world_size()
    denv = DistEnv(dist.get_rank(), world, denv.local_rank, denv.local_world_size,
                   denv.restart_count, denv.device)
    accum = cfg.accumulation_steps(world)
    if denv.device.type == "cpu":
        return_freed_host_memory()  # a CPU run's peak is its live tensors (see the docstring)
    check_memory(cfg, denv)
    metrics.record_start(cfg.steps, world, denv.restart_count)
    server = _serve_metrics(cfg, denv)
    ensure_checkpoint_location(cfg, denv.local_rank, control_pg, serving=server is not None)
    stop = StopAgreement().install()

    t = build_objects(cfg, denv)
    dataset = build_dataset(cfg)
    manager = CheckpointManager(open_storage(cfg.checkpoint_uri, cfg.checkpoint_endpoint),
                                keep=cfg.checkpoint_keep, async_save=cfg.checkpoint_async,
                                process_group=groups.checkpoint,
                                endpoint=cfg.checkpoint_endpoint)
    _resume(manager, t, cfg, denv)
    wandb_run = _maybe_wandb(cfg, denv)

    train_seconds, last_save = 0.0, time.monotonic()
    start_step = t.progress.step  # 0 unless this worker group resumed a checkpoint
    while t.progress.step < cfg.steps:
        t0 = time.monotonic()
        result = train_step(t, cfg, denv, dataset, accum)
        duration = time.monotonic() - t0
        train_seconds += duration
        _log_step(t, cfg, denv, result, duration, wandb_run)
        fault_injection.after_step(t.progress.step, denv.rank, fresh=start_step == 0)
        metrics.record_goodput(train_seconds / (time.monotonic() - started))
        if cfg.step_sleep_seconds:
            time.sleep(cfg.step_sleep_seconds)
        time_due = (cfg.checkpoint_interval_seconds > 0
                    and time.monotonic() - last_save >= cfg.checkpoint_interval_seconds)
        # One all-reduce decides, unanimously: stop? seconds-interval due? any upload busy?
        stopping, time_due, busy = stop.agree_with(control_pg, time_due, manager.in_flight())
        if stopping:
            emit("stopping", rank=denv.rank, step=t.progress.step, signalled=stop.signalled)
            manager.save(_save_request(t, cfg, dataset, world), blocking=True)
            manager.close()
            return _shutdown(stop.exit_code(), server)
        if should_checkpoint(t.progress.step, cfg.checkpoint_interval_steps, time_due):
            if busy:
                # A slow or failing store must not stall training: skip, the next one retries.
                if denv.is_coordinator:
                    emit("checkpoint_deferred", step=t.progress.step,
                         reason="previous upload still in flight")
            else:
                manager.save(_save_request(t, cfg, dataset, world))
                last_save = time.monotonic()
        manager.poll()

    manager.save(_save_request(t, cfg, dataset, world), blocking=True)
    manager.close()
    if not manager.holds(t.progress.step):
        # Never "finished" without the final state: a peer lost during the save restarts the
        # group (faults.guard_main reads the cause), a store failure is a counted crash; either
        # way the replacement resumes from the newest commit and trains the rest again.
        raise FinalCheckpointError(
            f"the final checkpoint (step {t.progress.step}) was not committed: "
            f"{manager.last_error}") from manager.last_error
    if denv.is_coordinator:
        emit("finished", step=t.progress.step, loss=t.progress.last_loss,
             failed_saves=manager.failed_saves)
    if denv.local_rank == 0:
        metrics.write_final_progress()
    return _shutdown(0, server)


class FinalCheckpointError(RuntimeError):
    """Training ended but its final checkpoint did not commit."""


def build_objects(cfg: TrainerConfig, denv: DistEnv) -> TrainObjects:
    """Model (wrapped), optimizer, schedule, scaler and guard, initialised identically on all
    ranks from the seed."""
    torch.manual_seed(cfg.seed)
    model = wrap_model(build_model(cfg.model, cfg.seq_len, cfg.vocab_size), cfg, denv)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    schedule = Schedule(cfg.lr_schedule, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps,
                        cfg.decay_fraction)
    scaler = torch.amp.GradScaler(denv.device.type, enabled=cfg.precision == "fp16")
    return TrainObjects(model, optimizer, build_scheduler(optimizer, schedule), scaler,
                        SpikeGuard(cfg.spike_factor), Progress())


def train_step(t: TrainObjects, cfg: TrainerConfig, denv: DistEnv, dataset: Dataset,
               accum: int) -> StepResult:
    """One optimizer step over the global batch that starts at progress.samples_seen."""
    torch.manual_seed(step_seed(cfg.seed, t.progress.step, denv.rank))
    t.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=denv.device)
    for k in range(accum):
        idx = micro_batch_indices(t.progress.samples_seen, cfg.micro_batch_size,
                                  denv.world_size, denv.rank, k)
        x, y = (z.to(denv.device) for z in make_batch(dataset, idx))
        with gradient_sync(t.model, k == accum - 1):
            with autocast(cfg, denv.device):
                loss = lm_loss(t.model(x), y) / accum
            torch.autograd.backward(t.scaler.scale(loss))
        loss_sum += loss.detach()
    t.scaler.unscale_(t.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), cfg.max_grad_norm or math.inf)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    loss_value = float(loss_sum) / denv.world_size
    skipped = t.guard.should_skip(loss_value, grad_norm)
    lr = float(t.optimizer.param_groups[0]["lr"])
    if skipped is None:
        t.scaler.step(t.optimizer)
    t.scaler.update()
    t.scheduler.step()
    t.guard.observe(loss_value, grad_norm, skipped is not None)
    p = t.progress
    p.step += 1
    p.samples_seen += cfg.global_batch_size
    p.tokens_seen += cfg.global_batch_size * cfg.seq_len
    p.last_loss = loss_value
    return StepResult(loss_value, grad_norm, lr, skipped)


def check_memory(cfg: TrainerConfig, denv: DistEnv) -> None:
    """Refuse, before allocating anything, a config that cannot fit this device."""
    est = estimate(cfg, denv.world_size, denv.device.type)
    metrics.record_memory_estimate(est.total_bytes)
    if denv.device.type == "cuda":
        check_fits(est, torch.cuda.mem_get_info(denv.device)[1], f"GPU {denv.device}")
    else:
        # Ranks on one host share its RAM.
        check_fits(est, available_host_bytes() // max(1, denv.local_world_size),
                   f"this host ({denv.local_world_size} rank(s))")


def _resume(manager: CheckpointManager, t: TrainObjects, cfg: TrainerConfig,
            denv: DistEnv) -> None:
    state = build_app_state(t)
    loaded = manager.load(state, cfg.resume_from)
    if loaded is None:
        if denv.is_coordinator:
            emit("fresh_start", world_size=denv.world_size, uri=manager.storage.uri)
        return
    apply_app_state(t, state)
    metrics.record_resumed(t.progress.step)
    if denv.is_coordinator:
        emit("resumed", step=t.progress.step, uri=loaded.uri, world_size=denv.world_size,
             saved_world_size=loaded.sidecar.get("world_size"),
             restart_count=denv.restart_count)


def _save_request(t: TrainObjects, cfg: TrainerConfig, dataset: Dataset,
                  world: int) -> SaveRequest:
    p = t.progress
    sidecar = {
        "step": p.step, "epoch": dataset.epoch_of(p.samples_seen), "loss": p.last_loss,
        "samples_seen": p.samples_seen, "tokens_seen": p.tokens_seen,
        "metrics": {"skipped_steps": t.guard.skipped_steps,
                    "lr": t.optimizer.param_groups[0]["lr"]},
        "world_size": world, "hostname": socket.gethostname(), "hardware": _hardware(),
        "torch_version": torch.__version__, "job_name": cfg.job_name, "model": cfg.model,
        "strategy": cfg.strategy, "time": time.time(),
    }
    return SaveRequest(p.step, build_app_state(t), sidecar)


def _log_step(t: TrainObjects, cfg: TrainerConfig, denv: DistEnv, r: StepResult,
              duration: float, wandb_run: Any) -> None:
    tokens = cfg.global_batch_size * cfg.seq_len
    metrics.record_step(t.progress.step, r.loss, duration, tokens)
    peak, measure = measure_peak(denv.device.type)
    metrics.record_peak_memory(peak, measure)
    if not denv.is_coordinator:
        return
    record: dict[str, Any] = {"step": t.progress.step, "loss": r.loss, "lr": r.lr,
              "grad_norm": r.grad_norm, "step_time": round(duration, 5),
              "tokens_per_s": round(tokens / max(duration, 1e-9), 1), "ram": _rss_bytes(),
              "vram": (torch.cuda.memory_allocated(denv.device)
                       if denv.device.type == "cuda" else 0),
              "peak_memory": peak, "world_size": denv.world_size}
    if r.skipped:
        record["skipped"] = r.skipped
    emit("step", **record)
    if wandb_run is not None:
        wandb_run.log(record, step=t.progress.step)


def _serve_metrics(cfg: TrainerConfig, denv: DistEnv) -> Any:
    if cfg.metrics_port == 0 or denv.local_rank != 0:
        return None
    try:
        return metrics.serve(cfg.metrics_port)
    except OSError as e:
        emit("metrics_unavailable", port=cfg.metrics_port, error=str(e))
        return None


def _maybe_wandb(cfg: TrainerConfig, denv: DistEnv) -> Any:
    if not cfg.wandb_project or not denv.is_coordinator:
        return None
    try:
        import wandb  # type: ignore[import-not-found]
    except ImportError:
        emit("wandb_unavailable", note="ELASTRAIN_WANDB_PROJECT set but wandb not installed")
        return None
    return wandb.init(project=cfg.wandb_project, name=cfg.job_name, config=vars(cfg),
                      resume="allow")


def _shutdown(code: int, server: Any) -> int:
    if server is not None:
        server.shutdown()
    dist.destroy_process_group()
    return code


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
