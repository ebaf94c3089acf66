"""session.dark_peers without a store or a group: whom a rank watches, and that a silent
neighbour ends the process as a lost peer (EXIT_RESTART) while a beating one never does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from torch.distributed import HashStore  # type: ignore[attr-defined]

from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.session.dark_peers import (
    MAX_MARKS,
    DarkPeerWatch,
    mark_dark,
    out_of_group,
)
from elastrain_trainer.session.restart_fence import STORE_RUN
from elastrain_trainer.signals import EXIT_RESTART


class Counters:
    """A store's heartbeat counters: `beating` peers move, the others never do."""

    def __init__(self, beating: set[str]) -> None:
        self.beating, self.counts = beating, dict[str, int]()

    def beat(self, node: str) -> int:
        return 0

    def heartbeats(self, nodes: Iterable[str]) -> dict[str, int | None]:
        for n in self.beating:
            self.counts[n] = self.counts.get(n, 0) + 1
        return {n: self.counts.get(n, 0) for n in nodes}


def test_a_rank_watches_its_two_ring_neighbours() -> None:
    assert DarkPeerWatch(lambda: None, 0, 8).peers == ["1", "7"]  # type: ignore[arg-type,return-value]
    assert DarkPeerWatch(lambda: None, 1, 2).peers == ["0"]  # type: ignore[arg-type,return-value]


def test_a_silent_neighbour_ends_the_process_a_beating_one_never() -> None:
    exits: list[int] = []
    done = threading.Event()

    def exit_(code: int) -> None:
        exits.append(code)
        done.set()

    quiet = DarkPeerWatch(lambda: Counters({"1", "3"}), 0, 4,  # type: ignore[arg-type,return-value]
                          timeout_s=2.0, exit=exit_).start()
    assert not done.wait(3.0)  # 1.5 timeouts: both neighbours beat
    quiet.stop()
    dark = DarkPeerWatch(lambda: Counters({"1"}), 0, 4,  # type: ignore[arg-type,return-value]
                         timeout_s=2.0, exit=exit_).start()
    assert done.wait(5.0) and exits == [EXIT_RESTART]
    dark.stop()


def test_once_the_loop_ended_a_rank_judges_nobody_and_beats_on() -> None:
    """Ranks leave at slightly different times: a quiet watch never ends its process for a
    neighbour that has ended, and keeps beating for the neighbours still judging."""
    exits: list[int] = []
    beats: list[str] = []
    store = Counters(set())
    store.beat = lambda node: beats.append(node) or 0  # type: ignore[method-assign]
    watch = DarkPeerWatch(lambda: store, 0, 4,  # type: ignore[arg-type,return-value]
                          timeout_s=2.0, exit=exits.append).start()
    watch.quiet()
    time.sleep(3.0)
    watch.stop()
    assert exits == [] and len(beats) >= 10


def test_a_rank_that_was_itself_stopped_judges_afresh_from_when_it_woke() -> None:
    """A frozen and thawed worker: its neighbours' silence over its own stop is not theirs.
    Its first look after the stop does not end the process (seen failing without the rule:
    the exit came on that very look); a silence that lasts a timeout from then still does."""
    looks: list[int] = []
    exits: list[int] = []
    done = threading.Event()
    stall_at = 3
    store = Counters({"1", "3"})
    heartbeats = store.heartbeats

    def look(nodes: Iterable[str]) -> dict[str, int | None]:
        looks.append(len(looks))
        if len(looks) == stall_at:
            time.sleep(2.5)  # this rank stopped for more than the timeout ...
        if len(looks) >= stall_at:
            store.beating = set()  # ... and its neighbours are gone
        return heartbeats(nodes)

    store.heartbeats = look  # type: ignore[method-assign]

    def exit_(code: int) -> None:
        exits.append(len(looks))
        done.set()

    watch = DarkPeerWatch(lambda: store, 0, 4,  # type: ignore[arg-type,return-value]
                          timeout_s=2.0, exit=exit_).start()
    assert done.wait(10.0)
    watch.stop()
    assert exits[0] > stall_at + 1, (exits, stall_at)


def test_a_dark_neighbour_is_marked_by_its_pod_before_the_process_ends() -> None:
    """The operator learns of the dark pod from the next group (issue 34 item 4): the rank
    that judged it marks its pod, never its own, before it exits."""
    marked: list[list[str]] = []
    done = threading.Event()
    watch = DarkPeerWatch(lambda: Counters({"3"}), 0, 4,  # type: ignore[arg-type,return-value]
                          timeout_s=2.0, exit=lambda code: done.set(),
                          pods=["pod-a", "pod-b", "pod-c", "pod-d"], mark=marked.append).start()
    assert done.wait(5.0)
    watch.stop()
    assert marked == [["pod-b"]]


def test_dark_marks_name_the_pods_a_forming_group_lacks_and_forget_those_it_holds() -> None:
    store = MembershipStore(HashStore(), STORE_RUN)
    assert out_of_group(store, {"a", "b"}) == []
    mark_dark(store, ["c"], 3)
    mark_dark(store, ["c", "d"], 4)
    assert out_of_group(store, {"a", "b"}) == ["c", "d"]
    assert out_of_group(store, {"a", "b", "c"}) == ["d"]  # c came back: its mark is dropped
    assert out_of_group(store, {"a", "b"}) == ["d"]
    mark_dark(store, [f"old-{i}" for i in range(40)], 5)
    assert len(out_of_group(store, set())) == MAX_MARKS  # bounded: marks outlive their pods


def test_two_writers_marking_at_once_both_land() -> None:
    store = MembershipStore(HashStore(), STORE_RUN)
    threads = [threading.Thread(target=mark_dark, args=(store, [f"p{i}"], 1))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out_of_group(store, set()) == sorted(f"p{i}" for i in range(8))
