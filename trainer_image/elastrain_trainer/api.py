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
loop and the process ends as in restart mode).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
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
from elastrain_trainer.faults import guard_main
from elastrain_trainer.inprocess.config import read_inprocess_config
from elastrain_trainer.inprocess.session import InProcessRuntime, PeerLostInSettle, find_model
from elastrain_trainer.loaders import ElasticSampler, StaleBatchError, tracker
from elastrain_trainer.loaders import install as _track_loaders
from elastrain_trainer.parallel import COLLECTIVE_TIMEOUT, DistEnv, Groups, read_dist_env
from elastrain_trainer.parallel import init_distributed as _init_all
from elastrain_trainer.session_state import (
    PROGRESS_KEY,
    ModelState,
    OptimizerState,
    Progress,
    Stateful,
    build_sidecar,
    build_state,
    should_checkpoint,
)
from elastrain_trainer.signals import EXIT_RESTART, StopAgreement

__all__ = ["DistEnv", "ElasticSampler", "FinalCheckpointError", "Session", "StaleBatchError",
           "World", "all_reduce", "init_distributed", "run"]

_groups: Groups | None = None
# The loaders' positions: in the checkpoint's sidecar and among the state sent to joiners.
DATA_KEY = "elastrain_data"
# ELASTRAIN_RECOVERY=inProcess (docs/recovery.md): this node's side of the protocol.
_inprocess: InProcessRuntime | None = None


class FinalCheckpointError(RuntimeError):
    """Training ended but its final checkpoint did not commit."""


def init_distributed() -> DistEnv:
    """Join torchrun's process group (gloo on CPU, NCCL for CUDA tensors) unless the script
    already did; returns where this process sits (rank, world_size, local_rank, device).
    Outside torchrun it is a world of one."""
    global _groups, _inprocess
    _track_loaders()  # the DataLoaders the script builds from now on follow the world
    denv = read_dist_env(os.environ)
    inprocess = read_inprocess_config(os.environ)
    if inprocess is not None:
        # Alone until the Session joins the job (Session.__enter__): build DDP on this.
        if _inprocess is None:
            cfg = TrainerConfig.from_env(os.environ, [])
            _inprocess = InProcessRuntime(inprocess, global_batch=cfg.global_batch_size,
                                          micro_batch=cfg.micro_batch_size)
        return _inprocess.env(denv)
    if not dist.is_initialized():
        _groups = _init_all(denv)
    elif _groups is None:
        # The script made its own default group: the session's small collectives get gloo
        # groups of their own (async DCP saves need gloo, and a thread of their own).
        control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        checkpoint = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        assert isinstance(control, dist.ProcessGroup)
        assert isinstance(checkpoint, dist.ProcessGroup)
        _groups = Groups(control, checkpoint)
    return dataclasses.replace(denv, rank=dist.get_rank(), world_size=dist.get_world_size())


def all_reduce(tensor: torch.Tensor,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """`dist.all_reduce` on the default group, for a collective of the script's own inside a
    step's body (a loss averaged over ranks). In in-process mode a peer lost here is noted, not
    raised: the tensor is left as it is and the Session redoes the step at the next yield (a
    plain `dist.all_reduce` would raise out of the script's loop and end the process as in
    restart mode). In restart mode it is `dist.all_reduce`."""
    if _inprocess is None:
        dist.all_reduce(tensor, op=op)
    else:
        _inprocess.peer_loss.all_reduce(tensor, op)


class StepCounter(Protocol):
    step: int


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process sits in one generation (Session(on_world_change=...) gets the old
    and the new one; the old one's world_size is 0 before the first)."""

    rank: int
    world_size: int


class Session:
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
        joined_live = _inprocess is not None and self._join()
        assert _groups is not None
        self._groups = _groups
        metrics.record_start(cfg.steps, self.denv.world_size, self.denv.restart_count)
        if not joined_live:  # a collective: a live job's members checked it long ago
            ensure_checkpoint_location(cfg, self.denv.local_rank, self._groups.control,
                                       serving=self._server is not None)
        # In-process mode: a SIGTERM is a leave, handled by the member (not a stop).
        self._stop = StopAgreement() if _inprocess is not None else StopAgreement().install()
        self.manager = CheckpointManager(
            open_storage(cfg.checkpoint_uri, cfg.checkpoint_endpoint), keep=cfg.checkpoint_keep,
            async_save=cfg.checkpoint_async, process_group=self._groups.checkpoint,
            endpoint=cfg.checkpoint_endpoint, run=self.run_id,
            wait_seconds=cfg.checkpoint_wait_seconds)
        if joined_live:
            self._settle()  # the state, the step and the rest from a live peer
        elif _inprocess is not None and _inprocess.sharded:
            # FSDP2: sharded at this world first (rank 0's model), then the checkpoint loaded
            # into the shards, as restart mode loads it.
            self._settle(announce=False)
            self._resumed = self._resume()
            self._announce()
        else:
            self._resumed = self._resume()
            if _inprocess is not None:
                self._settle()  # the first generation: DDP at its world (rank 0's broadcast)
        if _inprocess is None:
            self._enter_world()
        self._started, self._train_s = time.monotonic(), 0.0
        self._entered = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
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
            if _inprocess is not None:
                _inprocess.member.finish(self.step)
        self._close_server()
        _destroy_process_groups()
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
        while self.step < self.total_steps and not self.stopped:
            self._loss, self._tokens, self._fields = None, 0, {}
            t0 = time.monotonic()
            before = self._body_state() if _inprocess is not None else None
            yield self.step
            lost = _inprocess.peer_loss if _inprocess is not None else None
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
        if _inprocess is not None:
            lost: str | None = None
            try:
                change, time_due, busy = _inprocess.boundary(self.step, time_due,
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

    # -- in-process recovery (ELASTRAIN_RECOVERY=inProcess) --------------------------------
    def _join(self) -> bool:
        """Enter the job's current generation; True when it is a live job (not a start)."""
        global _groups
        assert _inprocess is not None
        self._ddp, self._optimizer = find_model(self._objects)
        _inprocess.use(self._ddp, self._optimizer, self._build)
        plan = _inprocess.join()
        _groups = _inprocess.member.groups
        return plan.reason != "start"

    def _settle(self, *, announce: bool = True) -> None:
        assert _inprocess is not None
        extras = self._extras()
        lost: str | None = None
        try:
            self.progress.step = _inprocess.settle(self._ddp, self._optimizer, self.step,
                                                   extras)
        except PeerLostInSettle as e:  # a peer lost during the heal or the re-wrap
            lost = str(e)
        if lost is not None:  # outside the `except`: its traceback holds the group
            self._recover(lost, in_body=False)  # the next generation, settled there
            return
        if announce:
            self._announce()

    def _announce(self) -> None:
        """The generation entered, in the manager, /progress and the log."""
        assert _inprocess is not None
        plan, last = _inprocess.member.plan, _inprocess.member.last
        if plan is not None and plan.reason != "start":
            # The next save re-reads the catalog on every member (a collective: rank 0's view),
            # so a joiner, which never loaded one, takes part in the same collectives.
            self.manager.catalog = None
        if last is not None and last.healed_from is not None:
            self._resumed = self.step
        assert plan is not None
        self._enter_world()
        metrics.record_generation(plan.gen, plan.world_size, self.step,
                                  regrouped=plan.reason != "start")
        if self.denv.is_coordinator or (last is not None and last.healed_from is not None):
            assert plan is not None and last is not None
            emit("regroup", gen=plan.gen, world_size=plan.world_size, reason=plan.reason,
                 step=self.step, node=_inprocess.member.node_id, healed_from=last.healed_from,
                 regroup_s=round(last.regroup_s, 4), heal_s=round(last.heal_s, 4),
                 kept_group=last.kept_group)

    def _regroup(self) -> None:
        """A leave or a join agreed at this boundary: the next generation, in this process."""
        global _groups
        assert _inprocess is not None
        self.manager.wait()  # a save never spans two generations
        if _inprocess.change(self.step) is None:
            if _inprocess.member.dissolving:
                self._dissolve()
                return
            if _inprocess.member.dropped:  # the change's generation failed without this node
                emit("dropped", node=_inprocess.member.node_id, step=self.step)
                self.stopped, self.exit_code, self._left = True, EXIT_RESTART, True
                return
            emit("left", node=_inprocess.member.node_id, step=self.step)
            self.stopped, self.exit_code, self._left = True, 0, True
            return
        groups = _inprocess.member.groups
        assert groups is not None
        _groups = self._groups = groups
        self.manager.pg = self._groups.checkpoint
        self._settle()

    def _dissolve(self) -> None:
        """Too few nodes remain for the smallest world (a drain, a SIGTERM to every node): as
        in restart mode, every node saves this step on the old group, then ends; a signalled
        node exits 0, the others EXIT_RESTART (the launcher restarts them in place as new nodes,
        which start the next generation from this checkpoint with the replacements). After a
        failure (a second loss) one survivor holding the step saves it alone."""
        global _groups
        assert _inprocess is not None
        signalled = _inprocess.member.signalled
        groups = _inprocess.member.groups
        assert groups is not None
        alone = getattr(self, "_groups", None) is not groups
        if alone:
            # After a failure the old group is gone and this node saves alone, in a world of
            # one: its catalog is re-read there (it may never have been this node's to read).
            _groups = self._groups = groups
            self.manager.pg, self.manager.catalog = groups.checkpoint, None
        emit("stopping", rank=self.denv.rank, step=self.step, signalled=signalled,
             reason="below the smallest world", alone=alone)
        if not self.manager.holds(self.step):  # a save of this step may have run already
            self.manager.save(self._request(), blocking=True)
        _groups = None
        del self._groups
        _inprocess.member.dissolve()
        self.stopped, self._left = True, True
        self.exit_code = 0 if signalled else EXIT_RESTART

    def _recover(self, error: str, *, in_body: bool) -> None:
        """A peer lost without notice (docs/recovery.md section 8): leave this generation,
        report the committed step (this one's, which the body did not commit, is redone) and
        enter the next at the smaller world, healed from a peer that committed more."""
        global _groups
        assert _inprocess is not None
        emit("peer_lost", node=_inprocess.member.node_id, step=self.step, in_body=in_body,
             error=error[:500])
        self.manager.wait()  # a save never spans two generations (it fails with the group)
        if _inprocess.sharded:
            # FSDP2 without notice: the lost node's shards are gone (no buddy copy), so restart
            # in place and resume from the newest checkpoint, as restart mode does.
            emit("shards_lost", node=_inprocess.member.node_id, step=self.step,
                 reason="a peer lost without notice holds FSDP2 shards nobody else has")
            self.stopped, self.exit_code, self._left = True, EXIT_RESTART, True
            return
        _groups = None  # with DDP's, every reference to the failed groups goes
        del self._groups
        if _inprocess.recover(self._ddp, self.step, error) is None:
            if _inprocess.member.dissolving:  # below the smallest world: save, alone, and end
                self._dissolve()
                return
            # The others went on without this node (judged dead): restart it, as today.
            emit("dropped", node=_inprocess.member.node_id, step=self.step)
            self.stopped, self.exit_code, self._left = True, EXIT_RESTART, True
            return
        groups = _inprocess.member.groups
        assert groups is not None
        _groups = self._groups = groups
        self.manager.pg = groups.checkpoint
        self._settle()

    def _extras(self) -> dict[str, Stateful]:
        """What moves beside the trained model and its optimizer (which heal and DDP move):
        the Session's other objects (a scheduler, a GradScaler, an EMA module, the built-in
        trainer's progress) and the loaders' positions."""
        extras = {k: v for k, v in self.state.items()
                  if not (isinstance(v, ModelState) and v.model is self._ddp)
                  and not (isinstance(v, OptimizerState) and v.optimizer is self._optimizer)}
        return {**extras, DATA_KEY: tracker}

    def _plan_batch(self) -> None:
        """The global and micro batch of the script's loader, for the plan (which world sizes
        keep the global batch) and the per-step check; refuses what cannot be re-split."""
        micro = tracker.micro_batch
        if _inprocess is not None and tracker.iterable:
            raise ValueError(
                f"a DataLoader over an IterableDataset ({', '.join(tracker.iterable)}) cannot "
                "be re-split when the world changes in process: use a map-style dataset with "
                "ElasticSampler or DistributedSampler, or spec.recovery.mode: Restart")
        if micro is None:
            tracker.global_batch = self._global_batch
            return
        replicas = (_inprocess.cfg.replicas if _inprocess is not None
                    else self.denv.world_size)
        tracker.global_batch = self._global_batch or micro * replicas
        if tracker.global_batch % micro:
            raise ValueError(f"Session(global_batch={tracker.global_batch}) is not a multiple "
                             f"of the DataLoader's batch_size {micro}")
        if _inprocess is not None:
            _inprocess.set_batch(tracker.global_batch, micro)

    def _enter_world(self) -> None:
        """A generation entered (or the run started): loaders split over it, then the
        script's callback."""
        old, self._world = self._world, World(self.denv.rank, self.denv.world_size)
        tracker.set_world(self._world.rank, self._world.world_size)
        if self._on_world_change is not None and old != self._world:
            self._on_world_change(old, self._world)

    def _body_state(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """What a step's body may advance besides model and optimizer state: the Session's
        other objects (a scheduler, the built-in trainer's progress) and the optimizer's
        hyper-parameters (a scheduler writes the LR into them); small, copied per step."""
        assert _inprocess is not None
        _inprocess.peer_loss.committed = False
        extras = {k: copy.deepcopy(v.state_dict()) for k, v in self._extras().items()}
        hyper = [{k: v for k, v in g.items() if k != "params"}
                 for g in self._optimizer.param_groups]
        return extras, copy.deepcopy(hyper)

    def _restore_body_state(self, saved: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
        extras, hyper = saved
        objects = self._extras()
        for k, sd in extras.items():
            objects[k].load_state_dict(sd)
        for group, values in zip(self._optimizer.param_groups, hyper, strict=True):
            group.update(values)

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


def _destroy_process_groups() -> None:
    global _groups
    _groups = None
    if dist.is_initialized():
        dist.destroy_process_group()


def run(main: Callable[[], object]) -> NoReturn:
    """Run a worker's main and exit the way the launcher and the operator read exits: a crash
    exits 1 with its exception recorded (counted against restartPolicy.maxRestarts), a lost peer
    EXIT_RESTART (restarted in place, uncounted); an int that main returns is the exit code."""
    code = guard_main(lambda: _exit_code(main()))
    sys.stdout.flush()
    sys.stderr.flush()
    # A background upload blocked on a dead peer must not keep a failed worker alive.
    os._exit(code)


def _exit_code(result: object) -> int:
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
