"""A worker moved off a node that gave notice trains on after its SIGTERM until a node is there
to take its place (issue 34 item 5; docs/recovery.md section 10, "Notices acted on first").

The operator moves a worker off a noticed node replacement first, and deletes the old pod only
once the replacement is in the world's plan. A drain quicker than that (Karpenter evicts within
seconds of its taint) SIGTERMs the old pod first; leaving at once would shrink the world until
the replacement joins (the world below its size, and two regroups instead of one). So the
operator names the pods it is moving (`POST /control`'s "moving"), and a SIGTERMed member whose
pod is among them holds its leave while nobody could take its place: no spare waits and the
world is no larger than when the hold began. It leaves once one could (the spare takes its
place at that change, or the grown world shrinks back to its size), or when its budget is
spent: the shutdown timeout its launcher gives it after the SIGTERM (PET_SHUTDOWN_TIMEOUT: the
pod's grace period less the operator's margin) less RESERVE_S for the leave itself and a stop's
save. Any other SIGTERM (no notice, a scale-down, a user) leaves at the next boundary.

The other hold is a local demo's (`wait_for_joiner`): `elastrain run --local
--simulate-preemption` starts the preempted agent's replacement while the survivor trains on
alone, and a fixed step count raced that start (on a loaded machine the survivor finished
before the replacement joined). Past a step the runner names, the world below its size waits
for the replacement's join request instead, bounded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping

from elastrain_trainer.events import emit
from elastrain_trainer.inprocess.membership import Plan, pod_of

# What a leave needs after the hold: a boundary, the change and, when the world drops below its
# minimum, the stop's save of this step.
RESERVE_S = 20.0
SHUTDOWN_TIMEOUT_ENV = "PET_SHUTDOWN_TIMEOUT"
TORCHRUN_SHUTDOWN_DEFAULT_S = 30.0


def hold_budget_s(environ: Mapping[str, str] = os.environ) -> float:
    """How long a moving member may hold its leave after its SIGTERM."""
    try:
        shutdown = float(environ.get(SHUTDOWN_TIMEOUT_ENV, TORCHRUN_SHUTDOWN_DEFAULT_S))
    except ValueError:
        shutdown = TORCHRUN_SHUTDOWN_DEFAULT_S
    return max(0.0, shutdown - RESERVE_S)


class LeaveHold:
    """Asked at each boundary of a signalled node that has not asked to leave yet."""

    def __init__(self, node_id: str, budget_s: float, moving: Callable[[], Collection[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pod = pod_of(node_id)
        self.node_id, self.budget_s, self.moving, self.clock = node_id, budget_s, moving, clock
        self._since: float | None = None
        self._world = 0  # the world when the hold began

    def holds(self, plan: Plan) -> bool:
        now = self.clock()
        if self._since is None:
            if self.pod not in self.moving() or self.budget_s <= 0:
                return False
            self._since, self._world = now, plan.world_size
            emit("leave_held", node=self.node_id, world=plan.world_size,
                 budget_s=round(self.budget_s, 1))
            return True
        waited = round(now - self._since, 2)
        if plan.spares or plan.world_size > self._world:
            emit("leave_hold_ended", node=self.node_id, reason="replaced", waited_s=waited,
                 world=plan.world_size, spares=len(plan.spares))
            return False
        if now - self._since >= self.budget_s:
            emit("leave_hold_ended", node=self.node_id, reason="budget", waited_s=waited,
                 world=plan.world_size, spares=0)
            return False
        return True


def wait_for_joiner(node_id: str, world: int, changed: Callable[[], bool],
                    stopped: Callable[[], bool], budget_s: float,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> str:
    """A local demo's pacing (TrainerConfig.join_wait_after_step), never a pod's: a world below
    its size waits before its next step until `changed` (the store's `pending` moved since the
    plan: a node asked to join or leave, so the next boundary changes the world), `stopped`
    (this node was signalled) or `budget_s` passed. Returns why it ended: "joining", "signalled"
    or "budget". Before the step, not before the boundary: the wait is no part of the step
    across the regroup that follows, whose length the summary reports as the survivors' pause."""
    since = clock()
    emit("join_wait", node=node_id, world=world, budget_s=round(budget_s, 1))
    while True:
        reason = ("joining" if changed() else "signalled" if stopped()
                  else "budget" if clock() - since >= budget_s else "")
        if reason:
            emit("join_wait_ended", node=node_id, reason=reason,
                 waited_s=round(clock() - since, 2))
            return reason
        sleep(0.05)
