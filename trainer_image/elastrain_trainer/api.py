"""Bring your own training script: what the built-in trainer does, for a plain torchrun script.

    from elastrain_trainer.api import Session, init_distributed, run

    def main() -> None:
        env = init_distributed()                       # torchrun's env -> process group
        model = DDP(Net().to(env.device))
        optimizer = torch.optim.AdamW(model.parameters())
        with Session(model=model, optimizer=optimizer) as session:   # resumes, if it can
            for step in session.steps():               # from the resumed step to ELASTRAIN_STEPS
                loss = train_one_step(step)             # the batch of `step`, on every rank
                session.report(loss=loss.item())

    if __name__ == "__main__":
        run(main)                                      # crash accounting, elastic exit codes

The session is the built-in trainer's machinery, not a copy: it reads the same ELASTRAIN_*
settings (TrainerConfig; the operator renders them from spec.checkpoint, spec.trainer.steps and
spec.metricsPort), checks the checkpoint location at start (checkpoint.precheck), loads the
newest committed checkpoint through CheckpointManager at any world size (DCP state dicts of every
keyword given to Session: modules, optimizers and anything with state_dict/load_state_dict),
saves every checkpoint.intervalSteps/intervalSeconds (async), serves /progress and /metrics, and
turns a SIGTERM on any rank into one save of the same step on every rank (signals.StopAgreement).
After that stop, `steps()` ends early and leaving the `with` block ends the process with the
code the elastic protocol needs (0 on the signalled rank, EXIT_RESTART on survivors): code after
the block runs only when training finished. `run(main)` is faults.guard_main, so a crash is
counted by the operator with its exception quoted, and a lost peer restarts in place.

Randomness is the script's: draw each step's batch from (seed, step) as the example does, and a
resumed run trains exactly what an uninterrupted one would have.

With ELASTRAIN_RECOVERY=inProcess (docs/recovery.md) the same loop survives a peer lost without
notice: DDP's gradient all-reduce notes the loss instead of raising, the optimizer applies
nothing, and `steps()` regroups and yields the same step again. A collective of the script's own
inside the loop must be `api.all_reduce` for that (a plain `dist.all_reduce` raises out of the
loop and the process ends as in restart mode). A sharded model's (FSDP2, HSDP) collectives run
inside forward and backward, where no hook can catch them: the body catches their RuntimeError,
hands it to `api.note_peer_loss` (True: noted, apply nothing more this step; False: re-raise),
as the built-in trainer does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader

from elastrain_trainer import fault_injection, metrics
from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest, open_storage
from elastrain_trainer.checkpoint.manager import LoadResult
from elastrain_trainer.checkpoint.precheck import ensure_checkpoint_location, give_up
from elastrain_trainer.checkpoint.read_faults import CheckpointUnavailableError
from elastrain_trainer.config import TrainerConfig, accumulation_steps
from elastrain_trainer.data import micro_batch_indices
from elastrain_trainer.events import emit
from elastrain_trainer.loaders import ElasticSampler, StaleBatchError, tracker
from elastrain_trainer.loaders import install as _track_loaders
from elastrain_trainer.parallel import DistEnv
from elastrain_trainer.session.process import (
    World,
    all_reduce,
    checkpoint_fence,
    destroy_process_groups,
    init_distributed,
    note_peer_loss,
    process,
    record_group_generation,
    run,
    training_ended,
)
from elastrain_trainer.session.stale_groups import StaleGroupError
from elastrain_trainer.session.state import (  # noqa: F401 - api's names for them
    PROGRESS_KEY,
    ModelState,
    OptimizerState,
    Progress,
    Stateful,
    StepCounter,
    build_sidecar,
    build_state,
    should_checkpoint,
)
from elastrain_trainer.session.world import DATA_KEY, WorldChanges
from elastrain_trainer.signals import StopAgreement

__all__ = ["DistEnv", "ElasticSampler", "FinalCheckpointError", "Session", "StaleBatchError",
           "StaleGroupError", "World", "all_reduce", "init_distributed", "note_peer_loss", "run"]


class FinalCheckpointError(RuntimeError):
    """Training ended but its final checkpoint did not commit."""


class Session(WorldChanges):
    """Resume, periodic and SIGTERM checkpoints, and progress for one training run.

    Every rank creates it with the same objects and iterates `steps()` in lockstep (the
    boundary of each step is a small collective). `steps` overrides ELASTRAIN_STEPS;
    `config` overrides reading TrainerConfig from the environment.

    For loops that keep more than a step count (the built-in trainer is one): `progress`, an
    object whose `step` the session advances, saved and restored by one of the objects (the
    session then stores no step of its own); `sidecar`, more fields for each checkpoint's JSON
    sidecar; `on_step`, called on the coordinator with each step record it emits.

    Data (docs/recovery.md section 11): `data=loader` names the training DataLoader (any
    DataLoader over a DistributedSampler or an ElasticSampler is found when it is built, so
    this is only needed for one built before init_distributed()); `global_batch=` fixes the
    global batch (default: the loader's batch size times spec.replicas). The Session splits
    those samplers over each generation's world and carries their position (epoch and offset)
    through saves, resumes, joins and a step redone after a lost peer; `accum` is the
    micro-batches per rank per step that keep the global batch at the current world.
    `on_world_change(old, new)` runs after each generation is entered (World), for what only
    the script knows (a process sub-group, a collective of its own).

    `build(mesh) -> (model, optimizer)`: needed for an FSDP2 (fully_shard) model with
    ELASTRAIN_RECOVERY=inProcess, ignored otherwise. At each world change the Session calls it
    on the new group's `mesh` (shard on it: `fully_shard(..., mesh=mesh)`), fills the new shards
    with the running values and turns the objects passed here into the new ones, so the
    script's `model`, `optimizer` and a scheduler on it keep working.
    """

    def __init__(self, *, steps: int | None = None, config: TrainerConfig | None = None,
                 progress: StepCounter | None = None,
                 sidecar: Callable[[], Mapping[str, Any]] | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 build: Callable[[DeviceMesh], tuple[nn.Module, torch.optim.Optimizer]]
                 | None = None,
                 data: DataLoader | Sequence[DataLoader] | None = None,  # type: ignore[type-arg]
                 global_batch: int | None = None,
                 on_world_change: Callable[[World, World], None] | None = None,
                 **objects: object) -> None:
        cfg = config or TrainerConfig.from_env(os.environ, [])
        if steps is not None:
            if steps < 1:
                raise ValueError(f"Session(steps={steps}): must be >= 1")
            cfg = dataclasses.replace(cfg, steps=steps)
        self.config = cfg
        self.state: dict[str, Stateful] = build_state(objects)
        self.progress: StepCounter
        if progress is None:
            self.progress = Progress()
            self.state[PROGRESS_KEY] = self.progress
        else:
            self.progress = progress
        self._sidecar, self._on_step = sidecar, on_step
        _track_loaders()
        for loader in [data] if isinstance(data, DataLoader) else (data or []):
            tracker.adopt(loader, train=True)
        if global_batch is not None and global_batch < 1:
            raise ValueError(f"Session(global_batch={global_batch}): must be >= 1")
        self._global_batch = global_batch
        self._on_world_change = on_world_change
        self._world = World(0, 0)
        self._fields: dict[str, Any] = {}
        self.stopped = False
        self.exit_code = 0
        self._loss: float | None = None
        self._tokens = 0
        self._entered = False
        self._resumed: int | None = None
        self._server: Any = None
        self._objects = objects
        self._build = build
        self._left = False

    # -- what the loop reads ------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps completed (and the index of the next one to train)."""
        return self.progress.step

    @property
    def total_steps(self) -> int:
        return self.config.steps

    @property
    def run_id(self) -> str:
        """This run's name in its commit markers: ELASTRAIN_RUN_ID, else torchrun's run id (the
        operator sets it to the job's uid, the same for every pod and restart of the job)."""
        return self.config.run_id or os.environ.get("TORCHELASTIC_RUN_ID", "")

    @property
    def resumed_from(self) -> int | None:
        """The step this run resumed from; None when it started fresh."""
        return self._resumed

    @property
    def rank(self) -> int:
        """This process's rank in the current generation."""
        return self._world.rank

    @property
    def world_size(self) -> int:
        return self._world.world_size

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks (Session(global_batch=), the loader's batch size
        times spec.replicas, else ELASTRAIN_GLOBAL_BATCH_SIZE); the same for the whole run."""
        return tracker.global_batch or self.config.global_batch_size

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch per rank: the training loader's batch size, else
        ELASTRAIN_MICRO_BATCH_SIZE."""
        return tracker.micro_batch or self.config.micro_batch_size

    @property
    def accum(self) -> int:
        """Micro-batches per rank per step at the current world (read it inside the loop)."""
        return accumulation_steps(self.global_batch, self.micro_batch, self.world_size)

    def micro_batch_indices(self, k: int) -> range:
        """Global sample indices of this rank's micro-batch k of the current step, for a script
        that reads samples by index: step s covers [s * global_batch, (s + 1) * global_batch)
        at any world size (the built-in trainer's order)."""
        return micro_batch_indices(self.step * self.global_batch, self.micro_batch,
                                   self.world_size, self.rank, k)

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Session:
        cfg = self.config
        self.denv = init_distributed()
        # Before the join: a spare waits in it, and answers the operator's poll meanwhile.
        self._server = self._serve_metrics()
        self._plan_batch()
        joined_live = process.inprocess is not None and self._join()
        assert process.groups is not None
        self._groups = process.groups
        metrics.record_start(cfg.steps, self.denv.world_size, self.denv.restart_count)
        if not joined_live:  # a collective: a live job's members checked it long ago
            ensure_checkpoint_location(cfg, self.denv.local_rank, self._groups.control,
                                       serving=self._server is not None)
        # In-process mode: a SIGTERM is a leave, handled by the member (not a stop).
        self._stop = StopAgreement() if process.inprocess is not None else StopAgreement().install()
        self.manager = CheckpointManager(
            open_storage(cfg.checkpoint_uri, cfg.checkpoint_endpoint), keep=cfg.checkpoint_keep,
            async_save=cfg.checkpoint_async, process_group=self._groups.checkpoint,
            endpoint=cfg.checkpoint_endpoint, run=self.run_id,
            wait_seconds=cfg.checkpoint_wait_seconds,
            fence=checkpoint_fence())
        if joined_live:
            self._settle()  # the state, the step and the rest from a live peer
        elif process.inprocess is not None and process.inprocess.sharded:
            # FSDP2: sharded at this world first (rank 0's model), then the checkpoint loaded
            # into the shards, as restart mode loads it.
            self._settle(announce=False)
            self._resumed = self._resume()
            self._announce()
        else:
            self._resumed = self._resume()
            if process.inprocess is not None:
                self._settle()  # the first generation: DDP at its world (rank 0's broadcast)
        if process.inprocess is None:
            if self.denv.is_coordinator:
                record_group_generation(self.manager)
            self._enter_world()
        self._started, self._train_s = time.monotonic(), 0.0
        self._entered = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        training_ended()
        if exc is not None:
            # A crash or a lost peer: no collective now (a peer may be gone); guard_main decides.
            self._close_server()
            return
        if self._left:  # in-process: this node left a live job; the others train on
            self.manager.close()
            self._close_server()
            raise SystemExit(self.exit_code)
        if not self.stopped:
            self.manager.save(self._request(), blocking=True)
        self.manager.close()
        if not self.stopped and not self.manager.holds(self.step):
            # As the built-in trainer: never "finished" without the final state (a lost peer
            # restarts the group, a store failure is a counted crash; guard_main tells them).
            self._close_server()
            raise FinalCheckpointError(
                f"the final checkpoint (step {self.step}) was not committed: "
                f"{self.manager.last_error}") from self.manager.last_error
        if not self.stopped and self.step >= self.total_steps:
            if self.denv.is_coordinator:
                emit("finished", step=self.step, loss=self._last_loss(),
                     failed_saves=self.manager.failed_saves)
            if self.denv.local_rank == 0:
                metrics.write_final_progress()
            if process.inprocess is not None:
                process.inprocess.member.finish(self.step)
        self._close_server()
        destroy_process_groups()
        if self.stopped:
            raise SystemExit(self.exit_code)

    # -- the loop ------------------------------------------------------------------------------
    def steps(self) -> Iterator[int]:
        """Yield the index of each step to train, from the resumed step to the total.

        After each step: progress and metrics, one agreement among ranks (stop? interval in
        seconds due? upload busy?), then a save when due. Ends early after a stop's save."""
        if not self._entered:
            raise RuntimeError("Session.steps() outside `with Session(...) as session:`")
        fresh = self.step == 0
        last_save = time.monotonic()
        join_wait = self.config.join_wait_after_step
        while self.step < self.total_steps and not self.stopped:
            if join_wait and self.step >= join_wait and process.inprocess is not None:
                join_wait = 0  # once: a replacement that never comes costs one budget
                process.inprocess.wait_for_joiner(self.config.join_wait_seconds)
            self._loss, self._tokens, self._fields = None, 0, {}
            t0 = time.monotonic()
            before = self._body_state() if process.inprocess is not None else None
            yield self.step
            lost = process.inprocess.peer_loss if process.inprocess is not None else None
            if lost is not None and lost.error is not None and not lost.committed:
                # A peer was lost during the body (DDP's all-reduce noted it, the optimizer
                # applied nothing): undo what the body advanced, recover, redo this step.
                assert before is not None
                self._restore_body_state(before)
                self._recover(lost.error, in_body=True)
                continue
            self.progress.step += 1
            tracker.check_step(self.step)
            self._record(time.monotonic() - t0)
            if lost is not None and lost.error is not None:  # after the optimizer step
                self._recover(lost.error, in_body=True)
                continue
            fault_injection.after_step(self.step, self.denv.rank, fresh=fresh)
            if self.config.step_sleep_seconds:
                time.sleep(self.config.step_sleep_seconds)
            if self._boundary(time.monotonic() - last_save):
                last_save = time.monotonic()
            self.manager.poll()

    def report(self, *, loss: float | None = None, tokens: int = 0, **fields: Any) -> None:
        """This step's loss (the mean over ranks, ideally) and tokens, for logs and /progress;
        other keywords (JSON values) go into the step's record as they are."""
        self._loss = None if loss is None else float(loss)
        self._tokens = tokens
        self._fields = fields

    # -- internals -------------------------------------------------------------------------
    def _boundary(self, since_save: float) -> bool:
        """Agree on stop and saves; True when a periodic save started."""
        cfg = self.config
        time_due = cfg.checkpoint_interval_seconds > 0 and (
            since_save >= cfg.checkpoint_interval_seconds)
        if process.inprocess is not None:
            lost: str | None = None
            try:
                change, time_due, busy = process.inprocess.boundary(self.step, time_due,
                                                             self.manager.in_flight())
            except RuntimeError as e:  # a peer lost without notice: its sockets closed
                lost = f"{type(e).__name__}: {e}"
            if lost is not None:  # outside the `except`: its traceback holds the group
                self._recover(lost, in_body=False)
                return False
            # A save due at this step runs on the old generation (the regroup waits for it).
            saved = self._save_if_due(time_due, busy)
            if change:
                self._regroup()
            return saved
        stopping, time_due, busy = self._stop.agree_with(self._groups.control, time_due,
                                                         self.manager.in_flight())
        if stopping:
            training_ended()
            emit("stopping", rank=self.denv.rank, step=self.step, signalled=self._stop.signalled)
            self.manager.save(self._request(), blocking=True)
            self.stopped, self.exit_code = True, self._stop.exit_code()
            return False
        return self._save_if_due(time_due, busy)

    def _save_if_due(self, time_due: bool, busy: bool) -> bool:
        if not should_checkpoint(self.step, self.config.checkpoint_interval_steps, time_due):
            return False
        if busy:
            if self.denv.is_coordinator:
                emit("checkpoint_deferred", step=self.step,
                     reason="previous upload still in flight")
            return False
        self.manager.save(self._request())
        return True

    def _record(self, duration: float) -> None:
        self._train_s += duration
        loss = self._last_loss()
        metrics.record_step(self.step, math.nan if loss is None else loss, duration,
                            self._tokens)
        metrics.record_goodput(self._train_s / max(1e-9, time.monotonic() - self._started))
        if self.denv.is_coordinator:
            record = {"step": self.step, "loss": math.nan if loss is None else loss,
                      **self._fields, "step_time": round(duration, 5),
                      "tokens_per_s": round(self._tokens / max(duration, 1e-9), 1),
                      "world_size": self.denv.world_size}
            emit("step", **record)
            if self._on_step is not None:
                self._on_step(record)

    def _last_loss(self) -> float | None:
        return self._loss

    def _request(self) -> SaveRequest:
        sidecar = build_sidecar(self.step, self._loss, self.denv.world_size, self.config.job_name)
        if tracker.samplers:
            sidecar[DATA_KEY] = tracker.state_dict()
        if self._sidecar is not None:
            sidecar.update(self._sidecar())
        return SaveRequest(self.step, {k: v.state_dict() for k, v in self.state.items()},
                           sidecar)

    def _resume(self) -> int | None:
        """Load the newest committed checkpoint, or start from step 0 when there is none (or
        checkpoint.resume is never). Never starts over because the store failed: that stops
        the worker with the reason (read_faults), and the next start tries again."""
        never = self.config.checkpoint_resume == "never"
        loaded: LoadResult | None = None
        failure: CheckpointUnavailableError | None = None
        try:
            loaded = self.manager.load(dict(self.state), self.config.resume_from,
                                       run=self.run_id if never else None)
        except CheckpointUnavailableError as e:
            failure = e
        if failure is not None:  # raised outside the `except`: no chained store error
            give_up(failure, self.denv.local_rank, self._groups.control,
                    serving=self._server is not None)
        lost = self._report_fallback(loaded)
        skipped = max((s.step for s in self.manager.skipped), default=None)
        if loaded is None:
            if self.denv.is_coordinator:
                emit("fresh_start", world_size=self.denv.world_size,
                     uri=self.manager.storage.uri, resume=self.config.checkpoint_resume,
                     skipped_step=skipped, steps_lost=lost)
            return None
        if DATA_KEY in loaded.sidecar:
            tracker.load_state_dict(loaded.sidecar[DATA_KEY])
        metrics.record_resumed(self.step)
        if self.denv.is_coordinator:
            emit("resumed", step=self.step, uri=loaded.uri, world_size=self.denv.world_size,
                 saved_world_size=loaded.sidecar.get("world_size"),
                 restart_count=self.denv.restart_count, skipped_step=skipped, steps_lost=lost)
        return self.step

    def _report_fallback(self, loaded: LoadResult | None) -> int:
        """Damaged checkpoints skipped on the way: told in /progress (the operator's condition
        and Warning event) and the log; returns the steps lost to them."""
        if not self.manager.skipped:
            return 0
        newest = max(self.manager.skipped, key=lambda s: s.step)
        lost = max(0, newest.step - (loaded.step if loaded is not None else 0))
        metrics.record_checkpoint_fallback(
            skipped_step=newest.step, skipped_uri=newest.uri, reason=newest.reason,
            loaded_step=None if loaded is None else loaded.step,
            loaded_uri=None if loaded is None else loaded.uri, steps_lost=lost,
            quarantined=newest.quarantined)
        if self.denv.is_coordinator:
            emit("checkpoint_fallback", skipped_step=newest.step, skipped_uri=newest.uri,
                 reason=newest.reason, quarantined=newest.quarantined,
                 loaded_step=None if loaded is None else loaded.step, steps_lost=lost,
                 skipped=len(self.manager.skipped))
        return lost

    def _serve_metrics(self) -> Any:
        if self.config.metrics_port == 0 or self.denv.local_rank != 0:
            return None
        try:
            return metrics.serve(self.config.metrics_port)
        except OSError as e:
            emit("metrics_unavailable", port=self.config.metrics_port, error=str(e))
            return None

    def _close_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
