"""inprocess.stuck: a training thread the sever did not release is restarted in place; one that
came out of the generation, or that saves a stop's last step, is left alone."""

from __future__ import annotations

import json
import threading

import pytest

from elastrain_trainer.inprocess.stuck import MIN_BOUND_S, StuckWatch, bound_for
from elastrain_trainer.signals import EXIT_RESTART


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def test_a_thread_still_in_the_severed_generation_restarts_the_process_in_place(
        capsys: pytest.CaptureFixture[str]) -> None:
    exits = Exits()
    watch = StuckWatch("b", 0.05, lambda gen: gen == 2, exit=exits)
    watch.severed(2)
    assert exits.done.wait(5)
    assert exits.codes == [EXIT_RESTART]
    [event] = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if "stuck_in_severed_generation" in line]
    assert (event["node"], event["gen"]) == ("b", 2) and event["after_s"] >= 0.05


def test_a_thread_that_came_out_of_the_generation_is_left_alone() -> None:
    exits = Exits()
    watch = StuckWatch("a", 0.05, lambda gen: True, exit=exits)
    watch.released(3)  # recovering from generation 3 (a kept plan may sever an older one)
    watch.severed(3).join(5)
    watch.severed(2).join(5)
    assert exits.codes == []


def test_a_thread_in_a_later_generation_or_saving_a_stop_is_left_alone() -> None:
    exits = Exits()
    watch = StuckWatch("a", 0.05, lambda gen: False, exit=exits)  # plan moved on, or dissolving
    watch.severed(4).join(5)
    assert exits.codes == []


def test_the_bound_is_far_above_a_released_collective_and_grows_with_the_heartbeat() -> None:
    assert bound_for(2.0) == MIN_BOUND_S
    assert bound_for(30.0) == 60.0


def told_then_ended(fails: bool) -> tuple[list[str], Exits]:
    order: list[str] = []
    exits = Exits()

    def before() -> None:
        order.append("told")
        if fails:
            raise OSError("the store is away")

    def exit_(code: int) -> None:
        order.append("exit")
        exits(code)

    watch = StuckWatch("b", 0.05, lambda gen: True, exit=exit_, before_exit=before)
    watch.severed(3)
    assert exits.done.wait(5)
    return order, exits


def test_the_member_is_told_before_the_process_ends_even_if_telling_fails() -> None:
    """The member announces its pod's rejoin first (a thawed node the world planned out,
    restarted this way, must not be replaced meanwhile); a failing announcement still ends
    the process."""
    for fails in (False, True):
        order, exits = told_then_ended(fails)
        assert order == ["told", "exit"] and exits.codes == [EXIT_RESTART]
