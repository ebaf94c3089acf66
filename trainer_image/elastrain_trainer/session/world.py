"""The Session's side of a world change: in-process recovery (ELASTRAIN_RECOVERY=inProcess,
docs/recovery.md: join, settle, regroup, recover, dissolve) and what follows the world in
both modes (the loaders' split and positions, the script's on_world_change, the state beside
the model that moves to joiners and is put back when a step is redone). A mixin of
api.Session: it owns these steps, the Session owns the loop and the checkpoints."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastrain_trainer import metrics
from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.events import emit
from elastrain_trainer.inprocess.membership import pod_of
from elastrain_trainer.inprocess.session import PeerLostInSettle, find_model
from elastrain_trainer.loaders import tracker
from elastrain_trainer.parallel import DistEnv, Groups
from elastrain_trainer.session.process import World, process
from elastrain_trainer.session.state import ModelState, OptimizerState, Stateful, StepCounter
from elastrain_trainer.signals import EXIT_RESTART

# The loaders' positions: in the checkpoint's sidecar and among the state sent to joiners.
DATA_KEY = "elastrain_data"


def _spec_batch() -> tuple[int | None, int | None]:
    """spec.trainer's global and micro batch where the job sets them (the operator renders
    only what is set: unset, a script's loader decides)."""
    values = [os.environ.get(f"ELASTRAIN_{name}_BATCH_SIZE") for name in ("GLOBAL", "MICRO")]
    return (int(values[0]) if values[0] else None, int(values[1]) if values[1] else None)


class WorldChanges:
    """What api.Session does when its world changes (see the module docstring)."""

    # The Session's, set in its __init__ and __enter__.
    config: TrainerConfig
    denv: DistEnv
    state: dict[str, Stateful]
    progress: StepCounter
    manager: CheckpointManager
    stopped: bool
    exit_code: int
    _groups: Groups
    _left: bool
    _resumed: int | None
    _objects: dict[str, object]
    _build: Any
    _ddp: nn.Module
    _optimizer: torch.optim.Optimizer
    _global_batch: int | None
    _on_world_change: Callable[[World, World], None] | None
    _world: World

    @property
    def step(self) -> int:
        return self.progress.step

    def _request(self) -> SaveRequest:
        raise NotImplementedError

    def _join(self) -> bool:
        """Enter the job's current generation; True when it is a live job (not a start)."""
        ip = process.inprocess
        assert ip is not None
        self._ddp, self._optimizer = find_model(self._objects)
        ip.use(self._ddp, self._optimizer, self._build)
        plan = ip.join()
        process.groups = ip.member.groups
        return plan.reason != "start"

    def _settle(self, *, announce: bool = True) -> None:
        ip = process.inprocess
        assert ip is not None
        extras = self._extras()
        lost: str | None = None
        try:
            self.progress.step = ip.settle(self._ddp, self._optimizer, self.step,
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
        ip = process.inprocess
        assert ip is not None
        plan, last = ip.member.plan, ip.member.last
        if plan is not None and plan.reason != "start":
            fence = ip.member.fence
            mine = fence.identity() if fence is not None else None
            if mine is not None and self.denv.is_coordinator:
                # The bucket learns of the generation before the world commits in it
                # (checkpoint/catalog.py: a node planned out with its old store is refused).
                self.manager.mark_generation(*mine)
            # The next save re-reads the catalog on every member (a collective: rank 0's view),
            # so a joiner, which never loaded one, takes part in the same collectives.
            self.manager.catalog = None
        if last is not None and last.healed_from is not None:
            self._resumed = self.step
        assert plan is not None
        self._enter_world()
        metrics.record_generation(plan.gen, plan.world_size, self.step,
                                  regrouped=plan.reason != "start")
        metrics.record_planned_out(plan.lost)
        metrics.record_world_pods(dict.fromkeys(map(pod_of, plan.nodes)),
                                  dict.fromkeys(map(pod_of, plan.spares)))
        if self.denv.is_coordinator or (last is not None and last.healed_from is not None):
            assert plan is not None and last is not None
            emit("regroup", gen=plan.gen, world_size=plan.world_size, reason=plan.reason,
                 step=self.step, node=ip.member.node_id, healed_from=last.healed_from,
                 regroup_s=round(last.regroup_s, 4), heal_s=round(last.heal_s, 4),
                 kept_group=last.kept_group, lost=list(plan.lost))

    def _regroup(self) -> None:
        """A leave or a join agreed at this boundary: the next generation, in this process."""
        ip = process.inprocess
        assert ip is not None
        self.manager.wait()  # a save never spans two generations
        if ip.change(self.step) is None:
            if ip.member.dissolving:
                self._dissolve()
                return
            if ip.member.dropped:  # the change's generation failed without this node
                emit("dropped", node=ip.member.node_id, step=self.step)
                self.stopped, self.exit_code, self._left = True, EXIT_RESTART, True
                return
            emit("left", node=ip.member.node_id, step=self.step)
            self.stopped, self.exit_code, self._left = True, 0, True
            return
        groups = ip.member.groups
        assert groups is not None
        process.groups = self._groups = groups
        self.manager.pg = self._groups.checkpoint
        self._settle()

    def _dissolve(self) -> None:
        """Too few nodes remain for the smallest world (a drain, a SIGTERM to every node): as
        in restart mode, every node saves this step on the old group, then ends; a signalled
        node exits 0, the others EXIT_RESTART (the launcher restarts them in place as new nodes,
        which start the next generation from this checkpoint with the replacements). After a
        failure (a second loss) one survivor holding the step saves it alone."""
        ip = process.inprocess
        assert ip is not None
        signalled = ip.member.signalled
        groups = ip.member.groups
        assert groups is not None
        alone = getattr(self, "process.groups", None) is not groups
        if alone:
            # After a failure the old group is gone and this node saves alone, in a world of
            # one: its catalog is re-read there (it may never have been this node's to read).
            process.groups = self._groups = groups
            self.manager.pg, self.manager.catalog = groups.checkpoint, None
        emit("stopping", rank=self.denv.rank, step=self.step, signalled=signalled,
             reason="below the smallest world", alone=alone)
        if not self.manager.holds(self.step):  # a save of this step may have run already
            self.manager.save(self._request(), blocking=True)
        process.groups = None
        del self._groups
        ip.member.dissolve()
        self.stopped, self._left = True, True
        self.exit_code = 0 if signalled else EXIT_RESTART

    def _recover(self, error: str, *, in_body: bool) -> None:
        """A peer lost without notice (docs/recovery.md section 8): leave this generation,
        report the committed step (this one's, which the body did not commit, is redone) and
        enter the next at the smaller world, healed from a peer that committed more."""
        ip = process.inprocess
        assert ip is not None
        emit("peer_lost", node=ip.member.node_id, step=self.step, in_body=in_body,
             error=error[:500])
        self.manager.wait()  # a save never spans two generations (it fails with the group)
        if ip.shards_die_with_a_node:
            # FSDP2 without notice: the lost node's shards are gone (no buddy copy), so restart
            # in place and resume from the newest checkpoint, as restart mode does.
            emit("shards_lost", node=ip.member.node_id, step=self.step,
                 reason="a peer lost without notice holds FSDP2 shards nobody else has")
            self.stopped, self.exit_code, self._left = True, EXIT_RESTART, True
            return
        process.groups = None  # with DDP's, every reference to the failed groups goes
        del self._groups
        if ip.recover(self._ddp, self.step, error) is None:
            if ip.member.dissolving:  # below the smallest world: save, alone, and end
                self._dissolve()
                return
            # The others went on without this node (judged dead): restart it, as today.
            emit("dropped", node=ip.member.node_id, step=self.step)
            self.stopped, self.exit_code, self._left = True, EXIT_RESTART, True
            return
        groups = ip.member.groups
        assert groups is not None
        process.groups = self._groups = groups
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
        if process.inprocess is not None and tracker.iterable:
            raise ValueError(
                f"a DataLoader over an IterableDataset ({', '.join(tracker.iterable)}) cannot "
                "be re-split when the world changes in process: use a map-style dataset with "
                "ElasticSampler or DistributedSampler, give the dataset __len__ and "
                "read(positions) (elastrain_trainer.loaders.stream) and the DataLoader a "
                "batch_size, or spec.recovery.mode: Restart")
        if micro is None:
            tracker.global_batch = self._global_batch
            return
        spec_global, spec_micro = _spec_batch()
        if spec_micro is not None and spec_micro != micro:
            raise ValueError(
                f"the DataLoader's batch_size {micro} is not spec.trainer.microBatchSize "
                f"{spec_micro} (ELASTRAIN_MICRO_BATCH_SIZE): make them equal, or unset "
                "spec.trainer.microBatchSize and the loader decides")
        if spec_global is not None and self._global_batch not in (None, spec_global):
            raise ValueError(
                f"Session(global_batch={self._global_batch}) is not spec.trainer."
                f"globalBatchSize {spec_global} (ELASTRAIN_GLOBAL_BATCH_SIZE): make them equal, "
                "or unset spec.trainer.globalBatchSize and the Session decides")
        inproc = process.inprocess.cfg if process.inprocess is not None else None
        replicas = (inproc.replicas * inproc.ranks_per_node if inproc is not None
                    else self.denv.world_size)
        tracker.global_batch = self._global_batch or spec_global or micro * replicas
        if tracker.global_batch % micro:
            raise ValueError(f"Session(global_batch={tracker.global_batch}) is not a multiple "
                             f"of the DataLoader's batch_size {micro}")
        if process.inprocess is not None:
            process.inprocess.set_batch(tracker.global_batch, micro)

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
        ip = process.inprocess
        assert ip is not None
        ip.peer_loss.committed = False
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
