"""The built-in trainer: model, data, schedule and guard, run as a user of the Session API
(elastrain_trainer.api), which resumes, checkpoints and stops on agreement for it.

Exit codes: 0 when training finished or this rank was SIGTERMed (after saving);
EXIT_RESTART (75) when another rank was SIGTERMed, so torchrun restarts this group.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from elastrain_trainer import fault_injection, metrics
from elastrain_trainer.api import Session, all_reduce, init_distributed, note_peer_loss
from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.data import (
    Dataset,
    build_dataset,
    build_validation_dataset,
    make_batch,
    micro_batch_indices,
)
from elastrain_trainer.estimate import (
    available_host_bytes,
    check_fits,
    estimate,
    measure_peak,
    return_freed_host_memory,
)
from elastrain_trainer.events import emit
from elastrain_trainer.guard import SpikeGuard
from elastrain_trainer.inprocess.session import known_world_size
from elastrain_trainer.model import build_model, lm_loss
from elastrain_trainer.parallel import DistEnv, autocast, gradient_sync, wrap_model
from elastrain_trainer.schedule import Schedule, build_scheduler
from elastrain_trainer.state import (
    Progress,
    TrainObjects,
    apply_trainer_state,
    step_seed,
    trainer_state,
)


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    skipped: str | None


def run(cfg: TrainerConfig) -> int:
    """Train per `cfg` inside the current torchrun worker; returns the exit code.

    The loop is a user of elastrain_trainer.api.Session, the API user scripts get: the session
    resumes, agrees on stops and saves at each step boundary, checkpoints and serves /progress;
    this module adds the model, data, schedule and guard of the built-in trainer."""
    denv = init_distributed()
    if denv.device.type == "cpu":
        return_freed_host_memory()  # a CPU run's peak is its live tensors (see the docstring)
    check_memory(cfg, denv)
    t = build_objects(cfg, denv)
    dataset = build_dataset(cfg)
    validation = build_validation_dataset(cfg)
    if known_world_size(denv) is not None:  # in process, the plan keeps the global batch
        cfg.accumulation_steps(denv.world_size)  # refuses a bad world size before training
    tokens = cfg.global_batch_size * cfg.seq_len
    session = Session(config=cfg, progress=t.progress, on_step=_wandb_logger(cfg),
                      sidecar=lambda: _sidecar(t, cfg, dataset),
                      # FSDP2 in in-process mode: how to shard at a new world
                      build=lambda mesh: model_and_optimizer(cfg, denv, mesh),
                      model=t.model, optim=t.optimizer, trainer=TrainerState(t))
    try:
        with session:
            for _ in session.steps():
                # Read inside the loop: with in-process recovery the world changes between steps.
                accum = cfg.accumulation_steps(denv.world_size)
                result = train_step(t, cfg, denv, dataset, accum)
                peak, measure = measure_peak(denv.device.type)
                metrics.record_peak_memory(peak, measure)
                fields: dict[str, Any] = {
                    "lr": result.lr, "grad_norm": result.grad_norm, "ram": _rss_bytes(),
                    "vram": (torch.cuda.memory_allocated(denv.device)
                             if denv.device.type == "cuda" else 0),
                    "peak_memory": peak}
                if result.skipped:
                    fields["skipped"] = result.skipped
                if validation is not None and should_validate(t.progress.step + 1, cfg):
                    fields["val_loss"] = validation_loss(t, cfg, denv, validation, accum)
                    metrics.record_validation(t.progress.step + 1, fields["val_loss"])
                session.report(loss=result.loss, tokens=tokens, **fields)
    except SystemExit as stop:  # the session's stop: this rank's exit code
        return stop.code if isinstance(stop.code, int) else 0
    return 0


def build_objects(cfg: TrainerConfig, denv: DistEnv) -> TrainObjects:
    """Model (wrapped), optimizer, schedule, scaler and guard, initialised identically on all
    ranks from the seed."""
    torch.manual_seed(cfg.seed)
    model, optimizer = model_and_optimizer(cfg, denv)
    schedule = Schedule(cfg.lr_schedule, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps,
                        cfg.decay_fraction)
    scaler = torch.amp.GradScaler(denv.device.type, enabled=cfg.precision == "fp16")
    return TrainObjects(model, optimizer, build_scheduler(optimizer, schedule), scaler,
                        SpikeGuard(cfg.spike_factor), Progress())


def model_and_optimizer(cfg: TrainerConfig, denv: DistEnv, mesh: DeviceMesh | None = None
                        ) -> tuple[nn.Module, torch.optim.AdamW]:
    """The wrapped model and its optimizer on the current default group (also how in-process
    recovery rebuilds an FSDP2 model on a new world's `mesh`: the values are then the running
    ones)."""
    model = wrap_model(build_model(cfg.model, cfg.seq_len, cfg.vocab_size), cfg, denv, mesh)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    return model, optimizer


def train_step(t: TrainObjects, cfg: TrainerConfig, denv: DistEnv, dataset: Dataset,
               accum: int) -> StepResult:
    """One optimizer step over the global batch that starts at progress.samples_seen."""
    torch.manual_seed(step_seed(cfg.seed, t.progress.step, denv.rank))
    fault_injection.in_body(t.progress.step)
    t.optimizer.zero_grad(set_to_none=True)
    lr = float(t.optimizer.param_groups[0]["lr"])
    try:
        loss_sum, grad_norm = _gradients(t, cfg, denv, dataset, accum)
    except RuntimeError as e:
        # FSDP2 and HSDP: a peer lost in a collective of forward or backward (DDP's comm hook
        # notes its own). In process it is noted and this step applies nothing; the Session
        # regroups at its yield and redoes the step.
        if not note_peer_loss(e):
            raise
        return StepResult(math.nan, math.nan, lr, None)
    all_reduce(loss_sum)  # in-process mode: a lost peer is noted, the step redone
    loss_value = float(loss_sum) / denv.world_size
    skipped = t.guard.should_skip(loss_value, grad_norm)
    if skipped is None:
        t.scaler.step(t.optimizer)
    t.scaler.update()
    t.scheduler.step()
    t.guard.observe(loss_value, grad_norm, skipped is not None)
    p = t.progress  # p.step is advanced by the session, after this body
    p.samples_seen += cfg.global_batch_size
    p.tokens_seen += cfg.global_batch_size * cfg.seq_len
    p.last_loss = loss_value
    return StepResult(loss_value, grad_norm, lr, skipped)


def _gradients(t: TrainObjects, cfg: TrainerConfig, denv: DistEnv, dataset: Dataset,
               accum: int) -> tuple[torch.Tensor, float]:
    """This rank's loss sum over its micro-batches, and the clipped gradients' norm."""
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
    return loss_sum, float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def should_validate(step: int, cfg: TrainerConfig) -> bool:
    """Evaluate after this (1-based) step? Every validation_interval_steps, and after the last."""
    return step % cfg.validation_interval_steps == 0 or step == cfg.steps


def validation_loss(t: TrainObjects, cfg: TrainerConfig, denv: DistEnv, dataset: Dataset,
                    accum: int) -> float:
    """The mean loss over the first validation_batches global batches of the validation split:
    each rank its micro-batches of each (as in training), the sums all-reduced. No gradients,
    no optimizer, no RNG draws the training depends on (each step reseeds): the training's
    samples and results are those of a run without validation."""
    t.model.eval()
    total = torch.zeros((), device=denv.device)
    with torch.no_grad():
        for batch in range(cfg.validation_batches):
            for k in range(accum):
                idx = micro_batch_indices(batch * cfg.global_batch_size, cfg.micro_batch_size,
                                          denv.world_size, denv.rank, k)
                x, y = (z.to(denv.device) for z in make_batch(dataset, idx))
                with autocast(cfg, denv.device):
                    total += lm_loss(t.model(x), y).float()
    t.model.train()
    all_reduce(total)
    return float(total) / (cfg.validation_batches * accum * denv.world_size)


def check_memory(cfg: TrainerConfig, denv: DistEnv) -> None:
    """Refuse, before allocating anything, a config that cannot fit this device."""
    # In process the world is not planned yet: a world of one is the largest share (FSDP).
    est = estimate(cfg, known_world_size(denv) or 1, denv.device.type, denv.local_world_size)
    metrics.record_memory_estimate(est.total_bytes)
    if denv.device.type == "cuda":
        check_fits(est, torch.cuda.mem_get_info(denv.device)[1], f"GPU {denv.device}")
    else:
        # Ranks on one host share its RAM.
        check_fits(est, available_host_bytes() // max(1, denv.local_world_size),
                   f"this host ({denv.local_world_size} rank(s))")


class TrainerState:
    """The built-in trainer's state beside model and optimizer (checkpointed as `trainer`):
    step, data position, scheduler, grad scaler and guard; small and the same on every rank."""

    def __init__(self, t: TrainObjects) -> None:
        self.t = t

    def state_dict(self) -> dict[str, Any]:
        return trainer_state(self.t)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        apply_trainer_state(self.t, state_dict)


def _sidecar(t: TrainObjects, cfg: TrainerConfig, dataset: Dataset) -> dict[str, Any]:
    p = t.progress
    return {
        "epoch": dataset.epoch_of(p.samples_seen), "samples_seen": p.samples_seen,
        "tokens_seen": p.tokens_seen,
        "metrics": {"skipped_steps": t.guard.skipped_steps,
                    "lr": t.optimizer.param_groups[0]["lr"]},
        "hardware": _hardware(), "model": cfg.model, "strategy": cfg.strategy,
        "source": "elastrain_trainer",
    }


def _wandb_logger(cfg: TrainerConfig) -> Callable[[dict[str, Any]], None] | None:
    """Step records to wandb, from the coordinator (the Session calls on_step there only;
    opened at its first record: in process, who coordinates is known only then)."""
    if not cfg.wandb_project:
        return None
    runs: list[Any] = []

    def log(record: dict[str, Any]) -> None:
        if not runs:
            try:
                import wandb  # type: ignore[import-not-found]
            except ImportError:
                emit("wandb_unavailable",
                     note="ELASTRAIN_WANDB_PROJECT set but wandb not installed")
                runs.append(None)
                return
            runs.append(wandb.init(project=cfg.wandb_project, name=cfg.job_name,
                                   config=vars(cfg), resume="allow"))
        if runs[0] is not None:
            runs[0].log(record, step=record["step"])

    return log


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
