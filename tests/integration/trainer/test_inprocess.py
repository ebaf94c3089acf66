"""In-process recovery on real processes (docs/recovery.md sections 3, 6 and 8; issue 21).

Each node is a real Python process (inprocess_worker.py: a tiny DDP model, AdamW, gloo on
loopback) against one real TCPStore hosted here, as the job's store pod would be. No mocks:
signals are real signals, a killed worker is SIGKILLed, the state a joiner receives crosses a
real gloo socket.

- exact resume: the world-size schedule 3 -> 2 -> 3 done in-process (a leave at step 10, a
  joiner at step 20) ends bit-identical to the same schedule done by restart-and-load;
- a worker leaving with notice (SIGTERM): survivors keep their PIDs, go on at world 2, 0 steps
  lost;
- a joiner is healed from a live peer (no checkpoint storage exists in these runs at all);
- a worker SIGKILLed (no notice), the coordinator or not: survivors go on at world 2, <= 1 step
  lost, all ranks' states equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.warmstart import started_pid

pytestmark = [pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("inprocess_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


@pytest.fixture
def job_store() -> Iterator[Any]:
    """The job's store: a TCPStore that no worker hosts."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                          wait_for_workers=False, use_libuv=True, timeout=timedelta(seconds=60))
    yield store


class Nodes:
    """Worker processes of one test, reaped at the end whatever happened."""

    def __init__(self, port: int, out: Path) -> None:
        self.port, self.out = port, out
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, mode: str, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.out / f"{name}.log").open("wb")
        proc = subprocess.Popen([sys.executable, str(WORKER), mode, "--port", str(self.port),
                                 "--out", str(self.out), *args], env=ENV, stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def node(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        return self.start("inprocess", name, "--node", name, *args)

    def wait_all(self, timeout: float = 240) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {n: p.wait(timeout=max(1.0, deadline - time.monotonic()))
                 for n, p in self.procs.items()}
        return codes

    def log_of(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text(errors="replace")[-3000:]

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def nodes(job_store: Any, tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(job_store.port, tmp_path)
    yield n
    n.kill_all()


def events(out: Path, node: str) -> list[dict[str, Any]]:
    path = out / f"{node}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def steps_of(evs: list[dict[str, Any]]) -> list[int]:
    return [e["step"] for e in evs if e["event"] == "step"]


def assert_same_state(want: dict[str, Any], got: dict[str, Any], what: str) -> None:
    assert want["step"] == got["step"], what
    for name, t in want["model"].items():
        assert torch.equal(t, got["model"][name]), f"{what}: model {name} differs"
    ws, gs = want["optimizer"]["state"], got["optimizer"]["state"]
    assert ws.keys() == gs.keys(), what
    for index in ws:
        for key, t in ws[index].items():
            assert torch.equal(t, gs[index][key]), f"{what}: optimizer {index}.{key} differs"


def final_digest(evs: list[dict[str, Any]]) -> str:
    digest: str = next(e for e in evs if e["event"] == "finished")["digest"]
    return digest


def pids(evs: list[dict[str, Any]]) -> set[int]:
    return {e["pid"] for e in evs}


# ---------------------------------------------------------------- exact resume (section 6)
def test_in_process_schedule_3_2_3_is_bit_identical_to_restart_and_load(
        nodes: Nodes, tmp_path: Path) -> None:
    out = tmp_path
    # In-process: c leaves (a real SIGTERM) after step 10; d, warm, joins at step 20.
    # (--hold-at: whichever node is rank 0 at step 20 lets d ask and waits for its request.)
    for name, extra in (("a", []), ("b", []), ("c", ["--leave-at", "10"]),
                        ("d", ["--join-gate", "test/join-go"])):
        nodes.node(name, "--steps", "30", "--hold-at", "20", *extra)
    codes = nodes.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, {n: nodes.log_of(n) for n in codes}
    ev = {n: events(out, n) for n in "abcd"}
    assert [e["event"] for e in ev["c"]][-1] == "left" and steps_of(ev["c"])[-1] == 10
    regroups = [(e["gen"], e["world"], e["reason"], e["step"]) for e in ev["a"]
                if e["event"] == "regroup"]
    assert regroups == [(2, 2, "leave", 10), (3, 3, "join", 20)], regroups
    assert ev["d"][0]["healed_from"] in {"a", "b"} and ev["d"][0]["step"] == 20
    for n in "ab":
        assert steps_of(ev[n]) == list(range(1, 31)) and len(pids(ev[n])) == 1
    inproc = {n: torch.load(out / f"{n}.pt", weights_only=False) for n in "abd"}

    # The same schedule by restart-and-load: fresh processes and groups at each change.
    restart = tmp_path / "restart"
    restart.mkdir()
    for world, until in ((3, 10), (2, 20), (3, 30)):
        runs = Nodes(nodes.port, restart)
        for rank in range(world):
            runs.start("restart", f"r{until}-{rank}", "--rank", str(rank), "--world",
                       str(world), "--until", str(until), "--steps", "30")
        codes = runs.wait_all()
        assert set(codes.values()) == {0}, {n: runs.log_of(n) for n in codes}
    want = torch.load(restart / "restart-30.pt", weights_only=False)
    for n in "abd":
        assert_same_state(want, inproc[n], f"in-process node {n} vs restart")


# ---------------------------------------------------------------- with notice (section 3)
def test_a_worker_leaving_with_notice_costs_survivors_no_restart_and_no_step(
        nodes: Nodes, tmp_path: Path) -> None:
    procs = {n: nodes.node(n, "--steps", "60", "--sleep", "0.05") for n in "abc"}
    wait_for(lambda: len(steps_of(events(tmp_path, "c"))) >= 5, "c at step 5")
    sent = time.time()
    procs["c"].send_signal(signal.SIGTERM)
    codes = nodes.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: nodes.log_of(n) for n in codes}
    ev = {n: events(tmp_path, n) for n in "abc"}
    left = [e for e in ev["c"] if e["event"] == "left"]
    assert len(left) == 1 and steps_of(ev["c"])[-1] == left[0]["step"]
    for n in "ab":
        # Same process all along (the Popen's pid), every step trained exactly once.
        assert pids(ev[n]) == {started_pid(procs[n].pid)}, n
        assert steps_of(ev[n]) == list(range(1, 61)), n
        regroup = [e for e in ev[n] if e["event"] == "regroup"]
        assert [(e["world"], e["reason"], e["step"]) for e in regroup] == [
            (2, "leave", left[0]["step"])], regroup
    # Every step after the leave ran at world 2; the first of them soon after the signal.
    after = [e for e in ev["a"] if e["event"] == "step" and e["step"] > left[0]["step"]]
    assert {e["world"] for e in after} == {2}
    first_at_2 = after[0]["t"] - sent
    print(f"SIGTERM -> first step at world 2: {first_at_2:.3f} s")
    assert first_at_2 < 5.0
    finals = {n: final_digest(ev[n]) for n in "ab"}
    assert finals["a"] == finals["b"]


def test_a_moving_worker_signalled_before_its_replacement_came_trains_on_until_it_has(
        nodes: Nodes, tmp_path: Path) -> None:
    # c's pod moves off a node with a notice (the operator's control says so) and a drain
    # SIGTERMs it before its replacement d exists: c trains on, the world stays at 3, and c
    # leaves only once d waits to take its place (inprocess.hold).
    procs = {n: nodes.node(n, "--steps", "250", "--sleep", "0.05",
                           *(["--moving"] if n == "c" else [])) for n in "abc"}
    wait_for(lambda: len(steps_of(events(tmp_path, "c"))) >= 5, "c at step 5")
    procs["c"].send_signal(signal.SIGTERM)
    signalled_at = steps_of(events(tmp_path, "c"))[-1]
    wait_for(lambda: len(steps_of(events(tmp_path, "c"))) >= signalled_at + 20,
             "c training on 20 steps after its SIGTERM")
    assert "leave_held" in nodes.log_of("c")
    nodes.node("d", "--steps", "250", "--sleep", "0.05")
    codes = nodes.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, {n: nodes.log_of(n) for n in codes}
    ev = {n: events(tmp_path, n) for n in "abcd"}
    left = [e for e in ev["c"] if e["event"] == "left"]
    assert len(left) == 1 and left[0]["step"] >= signalled_at + 20
    ended = [json.loads(line[line.index("{"):]) for line in nodes.log_of("c").splitlines()
             if '"leave_hold_ended"' in line]
    assert [e["reason"] for e in ended] == ["replaced"], ended
    # a trained every step at world 3: d waited as a spare, then took c's place.
    steps = [e for e in ev["a"] if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 251))
    assert {e["world"] for e in steps} == {3}
    regroups = [(e["world"], e["reason"]) for e in ev["a"] if e["event"] == "regroup"]
    assert regroups[-1] == (3, "leave") and all(w == 3 for w, _ in regroups), regroups
    assert ev["d"][0]["healed_from"] in {"a", "b", "c"}


def test_a_group_the_script_made_is_severed_with_its_generation(
        nodes: Nodes, tmp_path: Path) -> None:
    # Every step starts with an all-reduce on a group of the script's own (dist.new_group in
    # each generation). c freezes (SIGSTOP: no beat, no socket closed) with a and b blocked in
    # that all-reduce: they are released by the heartbeat's sever (inprocess.user_groups) and
    # regroup in their own processes; without it the stuck-thread bound restarts them.
    procs = {n: nodes.node(n, "--steps", "150", "--sleep", "0.05", "--user-group",
                           *(["--stall-at", "5"] if n == "c" else [])) for n in "abc"}
    # c stalls before that all-reduce at step 5 and freezes there: a and b wait in it.
    wait_for(lambda: any(e["event"] == "stalling" for e in events(tmp_path, "c")),
             "c stalling at step 5")
    frozen = started_pid(procs["c"].pid)
    os.kill(frozen, signal.SIGSTOP)
    try:
        wait_for(lambda: any(e["event"] == "regroup" and e["world"] == 2
                             for e in events(tmp_path, "a")), "a regrouped at world 2", 60)
    finally:
        os.kill(frozen, signal.SIGKILL)
    codes = nodes.wait_all()
    assert (codes["a"], codes["b"]) == (0, 0), {n: nodes.log_of(n) for n in "ab"}
    ev = {n: events(tmp_path, n) for n in "ab"}
    for n in "ab":
        assert pids(ev[n]) == {started_pid(procs[n].pid)}, n  # never restarted
        regroups = [(e["world"], e["reason"]) for e in ev[n] if e["event"] == "regroup"]
        assert regroups == [(2, "fail")], regroups
        assert steps_of(ev[n])[-1] == 150
    assert final_digest(ev["a"]) == final_digest(ev["b"])


# ---------------------------------------------------------------- a joiner (section 6)
def test_a_joiner_is_healed_from_a_live_peer_while_survivors_keep_training(
        nodes: Nodes, tmp_path: Path) -> None:
    # 200 steps of >= 0.05 s: the cold joiner below must come before the end. With 60 (~3.7 s
    # here) a and b finished twice before it had imported torch (stop 25, CI clone and loaded).
    total = 200
    procs = {n: nodes.node(n, "--steps", str(total), "--sleep", "0.05", "--expected", "2")
             for n in "ab"}
    wait_for(lambda: len(steps_of(events(tmp_path, "a"))) >= 3, "a at step 3")
    # A cold joiner: it imports torch and builds its model while a and b go on training.
    nodes.node("d", "--steps", str(total), "--sleep", "0.05")
    codes = nodes.wait_all()
    assert codes == {"a": 0, "b": 0, "d": 0}, {n: nodes.log_of(n) for n in codes}
    ev = {n: events(tmp_path, n) for n in "abd"}
    joined = ev["d"][0]
    assert joined["event"] == "joined" and joined["healed_from"] in {"a", "b"}
    assert joined["world"] == 3 and joined["rank"] == 2 and joined["step"] > 3
    for n in "ab":
        assert pids(ev[n]) == {started_pid(procs[n].pid)}, n
        assert steps_of(ev[n]) == list(range(1, total + 1)), n
        regroup = [e for e in ev[n] if e["event"] == "regroup"]
        assert [(e["world"], e["reason"], e["step"]) for e in regroup] == [
            (3, "join", joined["step"])], regroup
        # The joiner's state right after the transfer is the survivors' (checksummed).
        assert regroup[0]["digest"] == state_after_join(ev["d"])
    source = ev[joined["healed_from"]]
    assert next(e for e in source if e["event"] == "regroup")["sent_to"] == ["d"]
    assert steps_of(ev["d"]) == list(range(joined["step"] + 1, total + 1))
    finals = {n: final_digest(ev[n]) for n in "abd"}
    assert len(set(finals.values())) == 1, finals
    pause = max(e["seconds"] for e in ev["a"] if e["event"] == "regroup")
    print(f"survivors' pause for the joiner (regroup + transfer): {pause:.3f} s")
    assert not list(tmp_path.glob("**/ckpt*")), "no checkpoint storage is involved"


def state_after_join(evs: list[dict[str, Any]]) -> str:
    digest: str = evs[0]["digest"]
    return digest


# ---------------------------------------------------------------- no notice (section 8)
@pytest.mark.parametrize("victim_rank", [2, 0], ids=["member", "coordinator"])
def test_a_killed_worker_costs_survivors_at_most_one_step(
        nodes: Nodes, tmp_path: Path, victim_rank: int) -> None:
    procs = {n: nodes.node(n, "--steps", "60", "--sleep", "0.05") for n in "abc"}
    wait_for(lambda: all(events(tmp_path, n) for n in "abc"), "all joined")
    victim = next(n for n in "abc" if events(tmp_path, n)[0]["rank"] == victim_rank)
    wait_for(lambda: len(steps_of(events(tmp_path, victim))) >= 5, f"{victim} at step 5")
    killed = time.time()
    procs[victim].kill()
    codes = nodes.wait_all()
    survivors = [n for n in "abc" if n != victim]
    assert codes[victim] == -signal.SIGKILL
    assert all(codes[n] == 0 for n in survivors), {n: nodes.log_of(n) for n in survivors}
    ev = {n: events(tmp_path, n) for n in survivors}
    for n in survivors:
        assert pids(ev[n]) == {started_pid(procs[n].pid)}, n
        regroup = [e for e in ev[n] if e["event"] == "regroup"]
        assert [(e["world"], e["reason"]) for e in regroup] == [(2, "fail")], regroup
        # Nothing a survivor committed is lost (it resumes at or after its own committed step,
        # every step committed once); at most the step in flight is trained again.
        assert regroup[0]["step"] >= regroup[0]["in_flight"], regroup
        steps = steps_of(ev[n])
        assert steps == sorted(set(steps)) and steps[-1] == 60, steps
        # A step missing from its own record only when it committed elsewhere and was healed.
        missing = set(range(1, 61)) - set(steps)
        assert missing <= ({regroup[0]["step"]} if regroup[0]["healed_from"] else set())
        assert regroup[0]["in_flight"] + 1 - regroup[0]["step"] <= 1
        print(f"{n}: kill -> regrouped {regroup[0]['t'] - killed:.2f} s, "
              f"resumed at {regroup[0]['step']}, in flight {regroup[0]['in_flight']}")
        assert regroup[0]["t"] - killed < 10.0
    finals = {n: final_digest(ev[n]) for n in survivors}
    assert len(set(finals.values())) == 1, finals


def test_a_kill_is_planned_around_before_the_heartbeat_timeout(nodes: Nodes,
                                                                tmp_path: Path) -> None:
    # With a 10 s timeout (a beat every 2 s), the survivors know a collective failed: the node
    # that neither reports nor beats for 3 beats (6 s) is planned without, not after 10 s.
    procs = {n: nodes.node(n, "--steps", "40", "--sleep", "0.05", "--heartbeat-timeout", "10")
             for n in "abc"}
    wait_for(lambda: all(events(tmp_path, n) for n in "abc"), "all joined")
    wait_for(lambda: len(steps_of(events(tmp_path, "c"))) >= 5, "c at step 5")
    killed = time.time()
    procs["c"].kill()
    codes = nodes.wait_all()
    assert (codes["a"], codes["b"]) == (0, 0), {n: nodes.log_of(n) for n in "ab"}
    for n in "ab":
        regroup = [e for e in events(tmp_path, n) if e["event"] == "regroup"]
        assert [(e["world"], e["reason"]) for e in regroup] == [(2, "fail")], regroup
        print(f"{n}: kill -> regrouped {regroup[0]['t'] - killed:.2f} s (timeout 10 s)")
        assert regroup[0]["t"] - killed < 9.0
