"""A moving member's SIGTERM (inprocess.hold): it holds its leave while nobody could take its
place, for at most its budget; a member not told it moves leaves at once. A local demo's
survivor waits for its replacement's join request, bounded (wait_for_joiner)."""

from __future__ import annotations

import pytest

from elastrain_trainer.inprocess.hold import RESERVE_S, LeaveHold, hold_budget_s, wait_for_joiner
from elastrain_trainer.inprocess.membership import Plan
from elastrain_trainer.launch.local import join_wait_step


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


class Ticks(Clock):
    """A clock that each sleep moves on: the wait's polls, counted."""

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_demos_survivor_waits_until_a_node_asks_to_join(
        capsys: pytest.CaptureFixture[str]) -> None:
    clock = Ticks()
    asked_at = clock.now + 7.0
    why = wait_for_joiner("agent-0", 1, lambda: clock.now >= asked_at, lambda: False, 120.0,
                          clock, clock.sleep)
    assert why == "joining" and clock.now == pytest.approx(asked_at, abs=0.06)
    out = capsys.readouterr().out
    assert '"join_wait"' in out and '"join_wait_ended"' in out and '"waited_s": 7.0' in out


def test_the_demos_wait_ends_at_its_budget_or_a_signal() -> None:
    clock = Ticks()
    assert wait_for_joiner("agent-0", 1, lambda: False, lambda: False, 30.0, clock,
                           clock.sleep) == "budget"
    assert clock.now == pytest.approx(130.0, abs=0.06)
    assert wait_for_joiner("agent-0", 1, lambda: False, lambda: True, 30.0, clock,
                           clock.sleep) == "signalled"
    assert clock.now == pytest.approx(130.0, abs=0.06)  # at once


def test_the_demos_survivor_waits_late_enough_to_leave_steps_at_full_world() -> None:
    assert join_wait_step(80, 26) == 70  # the embedded demo: 10 steps left for the pair
    assert join_wait_step(60, 20) == 53
    assert join_wait_step(4, 3) == 4  # never before the preemption's step
