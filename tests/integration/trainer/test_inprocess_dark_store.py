"""A job's store that goes dark while the world trains or a spare waits (issue 34: the node that
hosts the store pod; docs/recovery.md section 7, "A store that stops answering").

The store's process is frozen (SIGSTOP): it closes nothing and answers nothing, as a store whose
node is partitioned or hung. Before, the coordinator's read of `pending` at every step boundary
waited for it, and with it every rank of the world: three nodes trained no step for the whole
15 s of a freeze. Now the boundary waits for the store at most a fifth of the heartbeat timeout
(at least 1 s), then trains on without it; each heartbeat thread notices the loss (its own
requests bounded by twice the timeout) and reconnects once the store answers again; nobody is
judged dead for a silence that was the store's. After the thaw the world still changes through
the store: a leave is planned as usual, so the training thread's client was replaced, not
reused after a request it gave up on. Checkpoints commit meanwhile (the fence's wait for the
store is bounded too). Seen failing with the boundary's bound off (0 steps in the 12 s, the
gap 12.0 s) and on the code before (no heartbeat ever lost the store or came back: TCPStore's
timeouts never end a request the server does not answer).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.ports import free_port
from tests.warmstart import started_pid

from .tcp_proxy import TcpProxy
from .test_inprocess import wait_for
from .test_inprocess_launcher import HEARTBEAT_S, Pods, serve, start_three
from .test_inprocess_spares import progress, regroups_after, spare_of, start_with_a_spare

pytestmark = [pytest.mark.timeout(300)]
FREEZE_S = 12.0
STEPS = "160"
SPARE_STEPS = "260"


@contextlib.contextmanager
def store_behind_a_name(tmp_path: Path, run: str) -> Iterator[tuple[Pods, Callable[[], None]]]:
    """Pods that reach the job's store by a name (a proxy here, the store's Service there), and
    `move()`: every open connection to the store stranded (nothing answered, nothing closed: its
    node dark) and the name leading to a new, empty store (the operator's replacement)."""
    old_port, new_port = free_port(), free_port()
    stores = [serve(old_port), serve(new_port)]
    proxy = TcpProxy("127.0.0.1", old_port).start()
    pods = Pods(tmp_path, proxy.port, run)
    try:
        yield pods, lambda: proxy.retarget("127.0.0.1", new_port)
    finally:
        pods.kill_all()
        for store in stores:
            store.kill()


def steps_between(recs: list[dict[str, Any]], start: float, end: float) -> list[float]:
    return [r["time"] for r in recs if r["event"] == "step" and start <= r["time"] <= end]


def test_a_frozen_store_stalls_no_step_and_the_world_changes_through_it_after(
        tmp_path: Path) -> None:
    port = free_port()
    store = serve(port)
    pods = Pods(tmp_path, port, "dark-store")
    try:
        for node in ("a", "b", "c"):
            pods.start(node, 3, STEPS=STEPS, MAX_REPLICAS="3")
        wait_for(lambda: pods.stepped() >= 10, "step 10 at world 3", timeout=180)
        pids = {n: pods.worker_pids(n) for n in pods.procs}
        frozen = time.time()
        # The store's own process: under a warm start (tests/warmstart) the Popen is a shim's,
        # which can pass a SIGSTOP on to nobody (it cannot catch it).
        frozen_pid = started_pid(store.pid)
        os.kill(frozen_pid, signal.SIGSTOP)
        time.sleep(FREEZE_S)
        os.kill(frozen_pid, signal.SIGCONT)
        thawed = time.time()
        wait_for(lambda: {r["node"] for r in pods.all_records() if r["event"] == "store_back"
                          and r["time"] > thawed} == {"a", "b", "c"}, "every heartbeat back",
                 timeout=60)
        step_at_leave = pods.stepped()
        pods.procs["c"].send_signal(signal.SIGTERM)
        wait_for(lambda: [r for r in pods.all_records() if r["event"] == "regroup"
                          and r["reason"] == "leave"], "c's leave planned")
        kept = {n: pods.worker_pids(n) for n in ("a", "b")}
        codes = pods.wait_all()
    finally:
        pods.kill_all()
        store.kill()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    recs = pods.all_records()
    # Trained on through the freeze: no gap near its length (it was the whole freeze before).
    during = [frozen, *steps_between(recs, frozen, thawed), thawed]
    gap = max(b - a for a, b in itertools.pairwise(during))
    print(f"store frozen {FREEZE_S:.0f} s: {len(during) - 2} steps meanwhile, longest gap "
          f"{gap:.2f} s")
    assert gap < FREEZE_S / 3, (gap, during)
    # Committed meanwhile: the checkpoint fence waits for the store at most 5 s, then commits
    # (before, its request waited for the thaw and every save meanwhile was deferred).
    saved = [r["step"] for r in recs if r["event"] == "checkpoint_saved"
             and frozen < r["time"] < thawed]
    assert len(set(saved)) >= 2, saved
    unanswered = [r for r in recs if r["event"] == "store_unanswered"]
    assert unanswered and all(frozen < r["time"] < thawed for r in unanswered), unanswered
    lost = {r["node"] for r in recs if r["event"] == "store_lost" and r["time"] > frozen}
    assert lost == {"a", "b", "c"}, lost
    # Nobody judged dead for the store's silence; the only change after is c's leave.
    changes = [r for r in recs if r["event"] == "regroup" and r["time"] > frozen]
    assert {r["reason"] for r in changes} == {"leave"} and \
        {r["world_size"] for r in changes} == {2}, changes
    assert min(r["step"] for r in changes) >= step_at_leave
    assert kept == {n: pids[n] for n in ("a", "b")}  # no worker restarted
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == list(range(1, int(STEPS) + 1)), steps  # every step once


def test_a_waiting_spare_follows_its_store_to_the_pod_that_replaced_it(tmp_path: Path) -> None:
    """Every pod reaches the store by a name (a proxy here, the store's Service there). The
    store's node goes dark while a spare waits: every open connection is stranded (nothing
    answered, nothing closed) and the name leads to a new, empty store (the operator's
    replacement on another node). The world follows it as before (restored, kept). Before, the
    spare's wait blocked on its stranded socket (until TCP gives up, ~15 minutes) while its
    heartbeat thread beat in the new store, so it read as a ready spare that could take no
    place; seen in e2e scenario 5, where a spare whose store ended with its connection closed
    ended its process instead (exit 76). Now it waits for the store to answer again and asks to
    join the new one, and takes a leaving member's place in its process."""
    with store_behind_a_name(tmp_path, "spare-store-moved") as (pods, move):
        ports = start_with_a_spare(pods, steps=int(SPARE_STEPS))
        spare = spare_of(ports)
        leaver, member = (n for n in ("a", "b", "c") if n != spare)
        moved = time.time()
        move()
        wait_for(lambda: any(r["event"] == "store_restored" and r["time"] > moved
                             for r in pods.all_records()), "the world restored into the new store",
                 timeout=90)
        wait_for(lambda: progress(ports[member])["spares"] == [spare],
                 "the world's plan in the new store names the spare", timeout=60)
        left_at = time.time()
        pods.procs[leaver].send_signal(signal.SIGTERM)
        wait_for(lambda: any(r["node"] == spare for r in regroups_after(pods, left_at)),
                 "the spare in the leaver's place", timeout=90)
        codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    joined = next(r for r in regroups_after(pods, left_at) if r["node"] == spare)
    assert (joined["reason"], joined["world_size"], joined["healed_from"]) == (
        "leave", 2, member), joined
    recs = pods.all_records()
    followed = next(r for r in recs if r["event"] == "store_followed" and r["node"] == spare)
    print(f"the spare followed its store {followed['time'] - moved:.1f} s after the move "
          f"(away {followed['away_s']} s), took {leaver}'s place "
          f"{joined['time'] - left_at:.2f} s after its SIGTERM")
    # Every pod trained or waited in one process throughout: nobody restarted in place.
    for node in ("a", "b", "c"):
        assert len({r["pid"] for r in pods.records(node) if r["event"] in (
            "regroup", "spare", "store_followed", "store_back", "left")}) == 1, node
    assert not [r for r in recs if r["event"] in ("resumed", "fresh_start")
                and r["time"] > moved]  # no restart: the spare healed from the member
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == list(range(1, int(SPARE_STEPS) + 1)), steps  # every step once


def test_a_member_dark_with_its_store_is_planned_out_in_the_store_that_replaced_it(
        tmp_path: Path) -> None:
    """The store's node hosts a worker too, and both go dark at once: the world's coordinator
    (rank 0, the hardest case) frozen (no beat, no socket closed) and every open connection to
    the store stranded, its name leading to a new, empty store. The survivors' collective waits
    on the frozen node, so no step boundary comes to restore the world into the new store;
    their heartbeat threads lose the old store (twice the timeout), reconnect to the new one
    and keep it, judge the frozen node silent there and fail the generation, which severs the
    collective; the survivors then restore the generation into the new store and re-form at
    world 2. Seen failing before: the sever read the peers' listeners from the new, empty
    store, so the pairs a survivor had connected stayed up and its collective waited until the
    stuck bound restarted it in place (world 1, then 2 with a survivor restarted); now the
    heartbeat reads them ahead (sever.Held.learn). And with the coordinator frozen nobody
    restored the new store (only rank 0 did), so the survivors never planned: now any node of
    the world restores, the first one winning. The thawed node's connections to the store are
    still stranded (the old store's node dark). Either its heartbeat thread reaches the new
    store first, and it finds itself planned out and comes back through the join path, or its
    recovery's first request, now bounded, goes unanswered and it ends as on a lost store
    (exit 1, RendezvousConnectionError), to be replaced; before, the latter waited on its socket
    for good. Its old process trains and commits nothing after the sever."""
    with store_behind_a_name(tmp_path, "store-and-peer-dark") as (pods, move):
        start_three(pods)
        (frozen,) = [n for n in ("a", "b", "c") if any(
            r["event"] == "regroup" and r["reason"] == "start" for r in pods.records(n))]
        survivors = sorted({"a", "b", "c"} - {frozen})
        dark = time.time()
        pods.signal_pod(frozen, signal.SIGSTOP)
        move()
        wait_for(lambda: [r for r in pods.all_records() if r["event"] == "regroup"
                          and r["reason"] == "fail"], "the survivors' regroup", timeout=90)
        fail = next(r for r in pods.all_records() if r["event"] == "regroup"
                    and r["reason"] == "fail")
        wait_for(lambda: any(r["event"] == "step" and r["time"] > fail["time"]
                             for r in pods.all_records()), "a step at world 2")
        pods.signal_pod(frozen, signal.SIGCONT)
        codes = pods.wait_all()
    recs = pods.all_records()
    print(f"the coordinator {frozen} and its store dark -> regrouped at world "
          f"{fail['world_size']} in {fail['time'] - dark:.2f} s (heartbeat timeout {HEARTBEAT_S} "
          f"s)")
    assert fail["world_size"] == 2 and fail["lost"] == [frozen], fail
    # Bounded by the store's loss (twice the timeout) and the silence after (the timeout),
    # with the tests' slack: not by the collective's timeout (5 minutes).
    assert fail["time"] - dark < 8 * HEARTBEAT_S + 10, fail
    assert [r for r in recs if r["event"] == "store_restored" and r["node"] in survivors
            and r["time"] > dark]
    assert {n: c for n, c in codes.items() if n in survivors} == dict.fromkeys(survivors, 0), {
        n: pods.log(n) for n in codes}
    if codes[frozen] == 1:
        assert "RendezvousConnectionError" in pods.log(frozen)
        assert "did not answer" in pods.log(frozen)
    else:
        assert codes[frozen] == 0, pods.log(frozen)
        assert [r for r in recs if r["event"] == "regroup" and r["node"] == f"{frozen}.1"
                and r["healed_from"] in survivors], recs
    frozen_pid = pods.records(frozen)[0]["pid"]
    assert not [r for r in pods.records(frozen) if r["pid"] == frozen_pid
                and r["time"] > fail["time"] and r["event"] in ("step", "checkpoint_saved")]
    regroups = [r for r in recs if r["event"] == "regroup"]
    assert not {r["node"] for r in regroups} & {f"{n}.1" for n in survivors}  # kept theirs
    assert not any(r["event"] == "resumed" for r in recs)  # nothing loaded from a checkpoint
    numbers = [r["step"] for r in recs if r["event"] == "step"]
    assert sorted(set(numbers)) == list(range(1, 81)), numbers
    assert len(numbers) - len(set(numbers)) <= 1, numbers  # <= 1 step trained twice
    # The commits before and after the store was replaced are of one lineage (the store that
    # founded the job's first generation), so the bucket compares their generations: a stale
    # commit of the frozen node's generation would be fenced there and refused by its writer.
    catalog = scan(LocalStorage(tmp_path / "ckpt"))
    lineages = {c.store_epoch for c in catalog.commits}
    assert len(lineages) == 1 and next(iter(lineages)).startswith("found:"), catalog.commits
    assert max(c.gen for c in catalog.commits) >= fail["gen"], catalog.commits
    assert not catalog.damaged, catalog.damaged
    # The new world's coordinator told the bucket of its generation as it entered it (before
    # its first commit there, a node its old store still vouched for would be refused).
    recorded = [n for n in survivors for r in pods.records(n)
                if r["event"] == "generation_recorded" and r["gen"] == fail["gen"]]
    assert len(recorded) == 1, [r for r in recs if r["event"].startswith("generation_")]
