"""What a Member is given and what it raises (inprocess.member, inprocess.admission)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, Protocol

import torch

from elastrain_trainer.inprocess.heartbeat import DEFAULT_TIMEOUT_S
from elastrain_trainer.inprocess.membership import Plan, PlanConfig


class PlanTimeoutError(RuntimeError):
    """No plan came for the next generation in time (the coordinator and its successors gone)."""


class NotHealedError(RuntimeError):
    """A node is not at its plan's step and the plan heals it from nobody (a protocol bug,
    not a lost peer: never recovered from as one)."""


class StoreFoundedError(Exception):
    """The store came back empty and a fresh node founded it before any node of this world
    claimed it (section 7): this world cannot restore into it, and two worlds of one job must
    not train side by side, so its pods end as on a lost store (replaced; resume from the
    newest checkpoint)."""

    def __init__(self, by: str | None) -> None:
        super().__init__(f"the job's store came back empty and {by or 'another node'} founded "
                         "it before this world reconnected")


class EntryFailedError(RuntimeError):
    """A node of the plan went silent before it entered the generation (or another node found
    so first): nobody inits that group; its nodes report and plan the next without it."""


@dataclasses.dataclass(frozen=True)
class MemberConfig:
    node_id: str
    store_host: str
    store_port: int
    run_id: str
    plan: PlanConfig
    expected: int                     # nodes the first generation waits for (spec.replicas)
    heartbeat_timeout_s: float = DEFAULT_TIMEOUT_S
    start_wait_s: float = 60.0        # the first generation starts with whoever came by then
    plan_wait_s: float = 60.0
    # spec.spares > 0: the world is the desired one (what `desired` last heard from the
    # operator, else `expected`) and the nodes beyond it wait as spares (section 9). 0: every
    # node up to plan.max_world trains, as before.
    spares: int = 0
    desired: Callable[[], int | None] = lambda: None
    on_role: Callable[[str], None] = lambda role: None  # "member" | "spare", for /progress
    # The pods the operator is moving off a node with a notice, and how long such a pod's
    # SIGTERMed member may hold its leave until a node can take its place (inprocess.hold).
    moving: Callable[[], Collection[str]] = frozenset
    hold_budget_s: float = 0.0
    # The pods the operator says are on a lost node: asked to leave (Admission._plan_out_lost).
    lost: Callable[[], Collection[str]] = frozenset
    # A pod the plan names lost announced its rejoin (heartbeat.Heartbeat's on_rejoin).
    on_rejoin: Callable[[str], None] = lambda pod: None
    # This rank's CUDA device: generations form on NCCL there (inprocess.nccl). None: gloo.
    device: torch.device | None = None


class Resharding(Protocol):
    """A sharded model's part in a change (inprocess/fsdp.Resharder): `handover` on the old
    group once the next plan is known, `settle` on the new group instead of heal + re-wrap."""

    def handover(self, old: Plan, plan: Plan, me: str) -> None: ...

    def settle(self, plan: Plan, me: str, step: int,
               extras: dict[str, Any]) -> tuple[int, dict[str, Any], bool]: ...


@dataclasses.dataclass
class Change:
    """What the last generation change did here (for logs, /progress and the tests)."""

    plan: Plan
    healed_from: str | None = None
    sent_to: list[str] = dataclasses.field(default_factory=list)
    regroup_s: float = 0.0
    heal_s: float = 0.0
    kept_group: bool = False  # only the spares changed: no regroup, heal or re-wrap
