"""A moving member's SIGTERM (inprocess.hold): it holds its leave while nobody could take its
place, for at most its budget; a member not told it moves leaves at once."""

from __future__ import annotations

import pytest

from elastrain_trainer.inprocess.hold import RESERVE_S, LeaveHold, hold_budget_s
from elastrain_trainer.inprocess.membership import Plan


def plan(world: int, spares: tuple[str, ...] = ()) -> Plan:
    nodes = tuple("abcdef"[:world])
    return Plan(gen=2, step=10, world_size=world, nodes=nodes, heal={}, reason="start",
                global_batch=12, accum=1, spares=spares)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_member_not_moving_leaves_at_once() -> None:
    hold = LeaveHold("c", 60.0, lambda: {"other-pod"})
    assert not hold.holds(plan(3))
    assert not LeaveHold("c", 0.0, lambda: {"c"}).holds(plan(3))  # no budget left


def test_it_holds_until_a_spare_waits(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    # Restarted in place, the node is `<pod>.<n>`: the pod is what the operator names.
    hold = LeaveHold("c.1", 60.0, lambda: {"c"}, clock)
    assert hold.holds(plan(3))
    clock.now += 30
    assert hold.holds(plan(3))
    assert hold.holds(plan(2))  # a peer lost meanwhile: still nobody to take its place
    assert not hold.holds(plan(3, spares=("d",)))
    out = capsys.readouterr().out
    assert '"leave_held"' in out and '"reason": "replaced"' in out


def test_it_holds_until_the_world_grew_or_the_budget_is_spent() -> None:
    clock = Clock()
    grown = LeaveHold("c", 60.0, lambda: {"c"}, clock)
    assert grown.holds(plan(2)) and not grown.holds(plan(3))  # the joiner trains beside it
    spent = LeaveHold("c", 60.0, lambda: {"c"}, clock)
    assert spent.holds(plan(3))
    clock.now += 59.9
    assert spent.holds(plan(3))
    clock.now += 0.1
    assert not spent.holds(plan(3))


def test_the_budget_is_the_launchers_shutdown_timeout_less_a_reserve() -> None:
    assert hold_budget_s({"PET_SHUTDOWN_TIMEOUT": "115"}) == 115 - RESERVE_S
    assert hold_budget_s({}) == 30 - RESERVE_S  # torchrun's default
    assert hold_budget_s({"PET_SHUTDOWN_TIMEOUT": "10"}) == 0.0
    assert hold_budget_s({"PET_SHUTDOWN_TIMEOUT": "x"}) == 30 - RESERVE_S
