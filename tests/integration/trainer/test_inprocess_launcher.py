"""In-process recovery under the launcher, as the operator renders a worker pod in InProcess mode
(docs/recovery.md section 10): `python -m elastrain_trainer.launch -m elastrain_trainer` with
torchrun standalone per node (PET_STANDALONE=1, one rank) and ELASTRAIN_RECOVERY=inProcess
against one real TCPStore, the job's store. Each launcher is a process-group leader, as a pod's
PID 1 is; the built-in trainer is its worker.

- a SIGTERM to one launcher (the pod's notice) reaches its worker, which leaves at the next step
  boundary; the launcher then exits 0; the survivors keep their worker processes and train every
  step exactly once (0 lost);
- a SIGKILL of one launcher's whole process group (the pod gone without notice): the survivors
  keep their worker processes and regroup within the heartbeat bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.inprocess import membership as m
from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.launch import rdzv_store
from elastrain_trainer.ports import free_port
from tests.warmstart import started_pid

from .conftest import trainer_env
from .tcp_proxy import TcpProxy
from .test_inprocess import wait_for
from .test_inprocess_builtin import job_store, records

pytestmark = [pytest.mark.timeout(300)]
__all__ = ["job_store"]  # the fixture, imported for the tests below
HEARTBEAT_S = 2.0
# A pod started while others train must import torch before they finish: 80 steps (8 s) were
# done first under a loaded machine (the e2e's image build beside it): 300 leave ~30 s.
LATE_JOINER_STEPS = "300"


def pod_env(root: Path, node: str, port: int, run: str, replicas: int,
            **extra: str) -> dict[str, str]:
    """What the operator renders for one worker pod in InProcess mode (the PET_* contract);
    `extra`'s PET_* keys replace the launcher's, the others are the trainer's."""
    pet = {k: v for k, v in extra.items() if k.startswith("PET_")}
    extra = {k: v for k, v in extra.items() if k not in pet}
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo",
            "PET_STANDALONE": "1", "PET_NNODES": "1", "PET_NPROC_PER_NODE": "1",
            "PET_MAX_RESTARTS": "1000000", "PET_MONITOR_INTERVAL": "0.5",
            "PET_SHUTDOWN_TIMEOUT": "25",
            "ELASTRAIN_RECOVERY": "inProcess", "ELASTRAIN_STORE": f"127.0.0.1:{port}",
            "ELASTRAIN_NODE_ID": node, "ELASTRAIN_RUN_ID": run,
            "ELASTRAIN_REPLICAS": str(replicas), "ELASTRAIN_MIN_REPLICAS": "1",
            "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": str(HEARTBEAT_S),
            "ELASTRAIN_TERMINATION_LOG": str(root / f"{node}.termination"),
            **trainer_env(root, **{"STEPS": "80", "GLOBAL_BATCH_SIZE": "12",
                                   "CHECKPOINT_INTERVAL_STEPS": "10", "CHECKPOINT_KEEP": "100",
                                   "STEP_SLEEP_SECONDS": "0.1", **extra}), **pet}


class Pods:
    """Launchers, each the leader of its own process group (a pod), reaped at the end."""

    def __init__(self, root: Path, port: int, run: str) -> None:
        self.root, self.port, self.run = root, port, run
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str, replicas: int, port: int | None = None,
              entry: tuple[str, ...] = ("-m", "elastrain_trainer"),
              **extra: str) -> subprocess.Popen[bytes]:
        """A pod; `port`: its own way to the store (default: the job's); `entry`: what the
        launcher runs (default: the built-in trainer)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastrain_trainer.launch", *entry],
            env=pod_env(self.root, node, port or self.port, self.run, replicas, **extra),
            stdout=(self.root / f"{node}.log").open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.procs[node] = proc
        return proc

    def records(self, node: str) -> list[dict[str, Any]]:
        return records(self.root / f"{node}.log")

    def all_records(self) -> list[dict[str, Any]]:
        return sorted((r for n in self.procs for r in self.records(n)), key=lambda r: r["time"])

    def stepped(self) -> int:
        return max((r["step"] for r in self.all_records() if r["event"] == "step"), default=0)

    def launcher_pid(self, node: str) -> int:
        """The launcher's own PID (a warm start's, not its shim's: tests/warmstart)."""
        return started_pid(self.procs[node].pid)

    def worker_pids(self, node: str) -> list[int]:
        """The launcher's workers: its child processes, one per local rank."""
        pid = self.launcher_pid(node)
        kids: list[int] = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                kids += [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
        return sorted(started_pid(k) for k in kids)

    def worker_pid(self, node: str) -> int | None:
        """The launcher's worker: its one child process (torchrun standalone, one rank)."""
        kids = self.worker_pids(node)
        return kids[0] if len(kids) == 1 else None

    def log(self, node: str) -> str:
        return (self.root / f"{node}.log").read_text(errors="replace")[-4000:]

    def wait_all(self, timeout: float = 240) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        return {n: p.wait(timeout=max(1.0, deadline - time.monotonic()))
                for n, p in self.procs.items()}

    def kill_pod(self, node: str) -> None:
        """SIGKILL everything of the pod (a pod's end kills every process in it)."""
        self.signal_pod(node, signal.SIGKILL)

    def signal_pod(self, node: str, sig: signal.Signals) -> None:
        """`sig` to every process of the pod: the launcher's process group and its worker's
        (torch starts each worker in a session of its own), and a warm start's shims."""
        worker = self.worker_pid(node)
        for group in (self.launcher_pid(node), worker, self.procs[node].pid):
            if group is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, sig)

    def kill_all(self) -> None:
        for node, p in self.procs.items():
            if p.poll() is None:
                self.kill_pod(node)
                p.wait()


@pytest.fixture
def pods(job_store: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pods]:
    p = Pods(tmp_path, job_store.port, request.node.name[:40])
    yield p
    p.kill_all()


def progress(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5) as r:
        doc: dict[str, Any] = json.load(r)
    return doc


def seconds(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def start_three(pods: Pods, ports: dict[str, int] | None = None,
                **extra: str) -> dict[str, int]:
    for node in ("a", "b", "c"):
        port = {"METRICS_PORT": str(ports[node])} if ports else {}
        pods.start(node, 3, **port, **extra)
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 3", timeout=180)
    pids = {n: pods.worker_pid(n) for n in pods.procs}
    assert None not in pids.values(), pids
    return {n: pid for n, pid in pids.items() if pid is not None}


def test_sigterm_to_a_launcher_leaves_the_job_and_the_survivors_keep_their_workers(
        pods: Pods) -> None:
    """Also /progress, as the operator reads it: the leave's recovery ends at the first
    trainingSince after the signal, in generation 2 at world 2, resumed from the leave's step."""
    ports = {n: free_port() for n in ("a", "b", "c")}
    pids = start_three(pods, ports)
    before = progress(ports["a"])
    assert (before["recoveryMode"], before["generation"], before["worldSize"]) == (
        "InProcess", 1, 3), before
    signalled = time.time()
    pods.procs["c"].send_signal(signal.SIGTERM)  # the kubelet signals the pod's PID 1 only
    wait_for(lambda: any(r["event"] == "regroup" and r["reason"] == "leave"
                         for r in pods.all_records()), "the regroup after the leave")
    survivors = {n: pods.worker_pid(n) for n in ("a", "b")}
    wait_for(lambda: (lambda d: d["generation"] == 2 and d["trainingSince"] is not None)(
        progress(ports["a"])), "a step at world 2")
    after = progress(ports["a"])
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    assert survivors == {n: pids[n] for n in ("a", "b")}  # no worker restarted
    left = [r for r in pods.records("c") if r["event"] == "left"]
    assert len(left) == 1
    steps = [(r["step"], r["world_size"]) for r in pods.all_records() if r["event"] == "step"]
    assert [s for s, _ in steps] == list(range(1, 81)), steps  # every step once: 0 lost
    assert {w for s, w in steps if s <= left[0]["step"]} == {3}
    assert {w for s, w in steps if s > left[0]["step"]} == {2}
    assert "the worker left the job cleanly" in pods.log("c")
    assert (after["generation"], after["worldSize"], after["resumedFromStep"]) == (
        2, 2, left[0]["step"]), after
    assert seconds(after["trainingSince"]) > signalled
    print(f"SIGTERM -> first step at world 2 in "
          f"{seconds(after['trainingSince']) - signalled:.2f} s")


def test_a_launcher_killed_with_its_worker_the_survivors_regroup_within_the_heartbeat_bound(
        pods: Pods) -> None:
    pids = start_three(pods)
    killed_at = time.time()
    pods.kill_pod("c")  # the pod gone without notice
    wait_for(lambda: any(r["event"] == "regroup" and r["reason"] == "fail"
                         for r in pods.all_records()), "the regroup after the loss")
    survivors = {n: pods.worker_pid(n) for n in ("a", "b")}
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": -signal.SIGKILL}, {n: pods.log(n) for n in codes}
    assert survivors == {n: pids[n] for n in ("a", "b")}  # no worker restarted
    fail = next(r for r in pods.all_records() if r["event"] == "regroup"
                and r["reason"] == "fail")
    took = fail["time"] - killed_at
    print(f"killed -> regrouped at world {fail['world_size']} in {took:.2f} s")
    assert fail["world_size"] == 2
    # A silent node is judged dead after the heartbeat timeout; slack for a loaded machine.
    assert took <= HEARTBEAT_S + 3.0, took
    steps = [r["step"] for r in pods.all_records() if r["event"] == "step"]
    assert sorted(set(steps)) == list(range(1, 81))
    assert len(steps) - len(set(steps)) <= 1  # <= 1 step (the one in flight) trained twice


def give_up_at(pods: Pods, node: str, step: int) -> dict[str, str]:
    """A fault file that makes `node`'s worker exit EXIT_RESTART once after `step`, as an
    in-process survivor that could not recover does."""
    path = pods.root / f"{node}.faults"
    path.write_text(f"ELASTRAIN_FAULT_GIVE_UP_AT_STEP={step}\n"
                    f"ELASTRAIN_FAULT_CRASH_ONCE={pods.root / f'{node}.fired'}\n")
    return {"ELASTRAIN_FAULT_INJECTION_FILE": str(path)}


def test_a_worker_that_gives_up_is_restarted_in_place_and_healed_from_a_live_peer(
        pods: Pods) -> None:
    pods.start("a", 2)
    pods.start("b", 2, **give_up_at(pods, "b", 12))
    wait_for(lambda: pods.stepped() >= 6, "step 6", timeout=180)
    first = pods.worker_pid("b")
    wait_for(lambda: any(r["event"] == "regroup" and r.get("node") == "b.1"
                         for r in pods.records("b")), "b's worker back as node b.1")
    assert pods.procs["b"].poll() is None  # the pod did not end: its launcher restarted it
    again = pods.worker_pid("b")
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0}, {n: pods.log(n) for n in codes}
    assert again is not None and again != first
    healed = next(r for r in pods.records("b") if r["event"] == "regroup"
                  and r.get("node") == "b.1")
    assert healed["healed_from"] == "a" and healed["world_size"] == 2, healed
    assert not any(r["event"] == "resumed" for r in pods.all_records())  # no checkpoint load
    steps = [(r["step"], r["world_size"]) for r in pods.all_records() if r["event"] == "step"]
    assert sorted({s for s, _ in steps}) == list(range(1, 81)), steps
    assert steps[-1] == (80, 2)


def test_a_worker_that_gives_up_with_no_live_generation_restarts_from_the_checkpoint(
        pods: Pods) -> None:
    """One node: its worker exits EXIT_RESTART after step 15; the launcher restarts it in
    place as node a.1, which finds generation 1 silent, starts generation 2 and loads the
    checkpoint of step 10 (the newest committed). Step 15, not 12: the async save of step 10
    must commit before the exit, and on a loaded machine it once took longer than 2 steps (the
    restarted node then started from step 0: the load was the machine's, not the protocol's)."""
    pods.start("a", 1, **give_up_at(pods, "a", 15))
    codes = pods.wait_all()
    assert codes == {"a": 0}, pods.log("a")
    recs = pods.records("a")
    start = [r for r in recs if r["event"] == "regroup" and r["reason"] == "start"]
    assert [(r["gen"], r["node"]) for r in start] == [(1, "a"), (2, "a.1")], start
    resumed = [r for r in recs if r["event"] == "resumed"]
    assert [r["step"] for r in resumed] == [10], resumed
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == list(range(1, 16)) + list(range(11, 81)), steps


def test_a_scale_up_pod_joins_the_world_up_to_max_replicas(pods: Pods) -> None:
    """ELASTRAIN_MAX_REPLICAS bounds the world, ELASTRAIN_REPLICAS only what the first
    generation waits for: a pod created after a scale-up (replicas 3) joins the two that
    started with replicas 2, and the world becomes 3 (not a spare)."""
    for node in ("a", "b"):
        pods.start(node, 2, MAX_REPLICAS="3", STEPS=LATE_JOINER_STEPS)
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 2", timeout=180)
    pods.start("c", 3, MAX_REPLICAS="3", STEPS=LATE_JOINER_STEPS)
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    join = [r for r in pods.all_records() if r["event"] == "regroup" and r["reason"] == "join"]
    assert join and join[0]["world_size"] == 3, join
    steps = [(r["step"], r["world_size"]) for r in pods.all_records() if r["event"] == "step"]
    assert [s for s, _ in steps] == list(range(1, int(LATE_JOINER_STEPS) + 1)), steps
    assert steps[0][1] == 2 and steps[-1][1] == 3


def two_at_step_10_then_a_faulty_joiner(pods: Pods, tmp_path: Path, knob: str,
                                        node: str = "c") -> dict[str, int | None]:
    """a and b train at world 2 up to step 10; then `node` asks to join with the fault `knob`
    set. Returns a's and b's worker PIDs once the survivors formed the generation after the
    one that failed."""
    for survivor in ("a", "b"):
        pods.start(survivor, 2, MAX_REPLICAS="3", STEPS=LATE_JOINER_STEPS)
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 2", timeout=180)
    pids = {n: pods.worker_pid(n) for n in ("a", "b")}
    assert None not in pids.values(), pids
    faults = tmp_path / "fault.env"
    faults.write_text(f"{knob}=1\n")
    pods.start(node, 3, MAX_REPLICAS="3", FAULT_INJECTION_FILE=str(faults),
               STEPS=LATE_JOINER_STEPS)
    wait_for(lambda: any(r["event"] == "regroup" and r["reason"] == "fail"
                         for r in pods.all_records()), "the generation after the failed one",
             timeout=120)
    return pids


def assert_the_survivors_trained_on_at_world_2(pods: Pods, pids: dict[str, int | None],
                                               injected: str) -> list[dict[str, Any]]:
    """a and b kept their worker processes through the failed entry, trained on at world 2
    without the joiner and finished every step exactly once. Returns the entry_failed
    records, for the test's own checks on them."""
    assert {n: pods.worker_pid(n) for n in ("a", "b")} == pids  # the same worker processes
    codes = {n: pods.procs[n].wait(timeout=240) for n in ("a", "b")}
    assert codes == {"a": 0, "b": 0}, {n: pods.log(n) for n in codes}
    assert injected in pods.log("c"), pods.log("c")
    recs = pods.all_records()
    failed = [r for r in recs if r["event"] == "entry_failed"]
    assert failed, [r for r in recs if r["event"] != "step"]
    gen = failed[0]["gen"]
    regroups = [(r["gen"], r["world_size"], r["reason"]) for r in recs if r["event"] == "regroup"]
    assert (gen + 1, 2, "fail") in regroups, regroups
    nodes = {r["node"] for r in recs if r["event"] == "regroup"}
    assert nodes <= {"a", "b"}, nodes  # never a.1 or b.1: nobody restarted in place
    after = next(r for r in recs if r["event"] == "regroup" and r["gen"] == gen + 1)
    print(f"generation {gen} failed at entry; generation {gen + 1} at world 2 "
          f"{after['time'] - failed[0]['time']:.2f} s after")
    kept = [r for r in recs if r["event"] == "step" and r["time"] > failed[0]["time"]]
    assert kept and {r["world_size"] for r in kept} == {2}, kept[:3]
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == list(range(1, int(LATE_JOINER_STEPS) + 1)), steps
    return failed


def test_a_joiner_that_freezes_before_entering_its_generation_costs_the_survivors_no_restart(
        pods: Pods, tmp_path: Path) -> None:
    """A scale-up pod asks to join and then stops answering (its worker SIGSTOPs itself: no
    heartbeat, no socket closed), so the coordinator plans it into the next generation. The
    survivors wait at that generation's arrival for it, judge it gone by its heartbeat and plan
    the one after without it, in their processes: same worker PIDs, no node restarted in place,
    every step trained once. Seen failing without the arrival wait (member._arrive): both
    survivors' inits wait 30 s for the frozen rank and they restart in place as a.1 and b.1."""
    pids = two_at_step_10_then_a_faulty_joiner(
        pods, tmp_path, "ELASTRAIN_FAULT_FREEZE_AFTER_JOIN_REQUEST")
    failed = assert_the_survivors_trained_on_at_world_2(
        pods, pids, "injected freeze after the join request")
    # One survivor judged c gone, the other saw that (or judged it too); c never arrived.
    assert set().union(*(r["lost"] for r in failed)) == {"c"}, failed
    assert {tuple(r["missing"]) for r in failed} == {("c",)}, failed


def test_a_joiner_that_freezes_inside_the_groups_init_costs_the_survivors_no_restart(
        pods: Pods, tmp_path: Path) -> None:
    """As above, but the joiner freezes after it arrived (every planned node arrived, so the
    survivors' inits start and wait inside gloo's rendezvous for its address). The init of a
    non-start generation has a bound of its own (regroup.ENTRY_INIT_TIMEOUT, 10 s): when it
    passes, the survivors tear down, report and plan the next generation without the frozen
    node, in their processes. Seen failing with the init bounded by the 30 s collective
    timeout instead: each survivor's worker failed with the init error and restarted in place
    (a.1, b.1), resuming from the checkpoint."""
    pids = two_at_step_10_then_a_faulty_joiner(
        pods, tmp_path, "ELASTRAIN_FAULT_FREEZE_AFTER_ARRIVE")
    failed = assert_the_survivors_trained_on_at_world_2(
        pods, pids, "injected freeze after arriving")
    assert {r["node"] for r in failed} == {"a", "b"}, failed
    assert all(r["missing"] == [] and "init" in r["reason"] for r in failed), failed


def test_a_joiner_lost_during_its_heal_costs_the_survivors_no_restart(
        pods: Pods, tmp_path: Path) -> None:
    """A scale-up pod's worker is killed while it is being healed (its source's header
    received, the state not: the fault file). The source's send or the re-wrap's check across
    ranks fails; the survivors treat that as a failed collective (report, plan the next
    generation without the dead node) in their processes. A replacement joins later and is
    healed. Seen failing without the handling: the heal's source (b) failed with the
    re-wrap's error ("Connection reset by peer") and restarted in place as b.1, while a trained
    on alone at world 1."""
    pids = two_at_step_10_then_a_faulty_joiner(pods, tmp_path, "ELASTRAIN_FAULT_KILL_DURING_HEAL")
    assert pods.procs["c"].wait(timeout=60) != 0  # its worker SIGKILLed: the pod failed
    assert "injected kill during the heal" in pods.log("c"), pods.log("c")
    pods.start("c2", 3, MAX_REPLICAS="3", STEPS=LATE_JOINER_STEPS)
    wait_for(lambda: any(r["event"] == "regroup" and r["world_size"] == 3
                         and r.get("healed_from") for r in pods.all_records()),
             "the replacement healed at world 3", timeout=180)
    assert {n: pods.worker_pid(n) for n in ("a", "b")} == pids  # the same worker processes
    codes = {n: pods.procs[n].wait(timeout=240) for n in ("a", "b", "c2")}
    assert codes == {"a": 0, "b": 0, "c2": 0}, {n: pods.log(n) for n in codes}
    recs = pods.all_records()
    lost = [r for r in recs if r["event"] == "peer_lost"]
    assert lost and {r["node"] for r in lost} <= {"a", "b"}, lost
    regroups = [(r["world_size"], r["reason"], r["node"]) for r in recs
                if r["event"] == "regroup" and r["time"] > lost[0]["time"]]
    print(f"after the loss during the heal: {regroups}")
    assert regroups[0][:2] == (2, "fail"), regroups
    nodes = {r["node"] for r in recs if r["event"] == "regroup"}
    assert nodes <= {"a", "b", "c2"}, nodes  # never a.1 or b.1: no survivor restarted
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == list(range(1, int(LATE_JOINER_STEPS) + 1)), steps


def stopping_step(pods: Pods, nodes: tuple[str, ...]) -> int:
    stops = {r["step"] for n in nodes for r in pods.records(n) if r["event"] == "stopping"}
    assert len(stops) == 1, stops
    return stops.pop()


# No periodic checkpoint: the only one to resume from is the one the stop saves.
NO_PERIODIC = {"CHECKPOINT_INTERVAL_STEPS": "1000"}


def resume_with_replacements(pods: Pods, names: tuple[str, ...], replicas: int) -> None:
    for node in names:
        pods.start(node, replicas, MIN_REPLICAS="2", **NO_PERIODIC)


def assert_resumed_with_nothing_lost(pods: Pods, stopped: int, steps: int = 80) -> None:
    resumed = [r for r in pods.all_records() if r["event"] == "resumed"]
    assert resumed and {r["step"] for r in resumed} == {stopped}, resumed
    trained = [r["step"] for r in pods.all_records() if r["event"] == "step"]
    assert trained == list(range(1, steps + 1)), trained  # every step once: 0 lost


def test_sigterm_to_every_launcher_saves_the_step_and_the_replacements_resume_from_it(
        pods: Pods) -> None:
    start_three(pods, **NO_PERIODIC)
    for node in ("a", "b", "c"):
        pods.procs[node].send_signal(signal.SIGTERM)
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    stopped = stopping_step(pods, ("a", "b", "c"))
    assert (pods.root / "ckpt" / f"step-{stopped:08d}").is_dir()
    resume_with_replacements(pods, ("a2", "b2", "c2"), 3)
    codes = pods.wait_all()
    assert set(codes.values()) == {0}, {n: pods.log(n) for n in codes}
    assert_resumed_with_nothing_lost(pods, stopped)


def test_a_leave_below_min_replicas_saves_the_step_and_restarts_the_survivor_in_place(
        pods: Pods) -> None:
    """min 2: a drain evicts a and b; c alone is below the smallest world. All three save the
    step on the old group; a and b exit 0, c's worker exits EXIT_RESTART and its launcher
    restarts it in place (node c.1), which starts the next generation with the replacements
    a2 and b2 from that checkpoint: 0 steps lost."""
    for node in ("a", "b", "c"):
        pods.start(node, 3, MIN_REPLICAS="2", **NO_PERIODIC)
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 3", timeout=180)
    first = pods.worker_pid("c")
    for node in ("a", "b"):
        pods.procs[node].send_signal(signal.SIGTERM)
    assert {n: pods.procs[n].wait(timeout=120) for n in ("a", "b")} == {"a": 0, "b": 0}
    wait_for(lambda: pods.worker_pid("c") not in (None, first), "c's worker restarted")
    assert pods.procs["c"].poll() is None  # in place: the pod did not end
    stopped = stopping_step(pods, ("a", "b", "c"))
    resume_with_replacements(pods, ("a2", "b2"), 3)
    codes = pods.wait_all()
    assert set(codes.values()) == {0}, {n: pods.log(n) for n in codes}
    assert_resumed_with_nothing_lost(pods, stopped)


def test_two_pods_killed_a_second_apart_the_survivor_trains_on_alone(pods: Pods) -> None:
    """min 1: b's pod and, 1 s later, c's are SIGKILLed. a's launcher never ends: a regroups
    at world 1 (a node that reported and then went silent counts as dead), or, when a plan
    still named c, its worker exits EXIT_RESTART and comes back in place as a.1, which starts
    from the newest checkpoint. Either way the job finishes in a's pod, every step trained."""
    start_three(pods)
    wait_for(lambda: pods.stepped() >= 12, "step 12 (the checkpoint of step 10 committed)")
    killed_at = time.time()
    pods.kill_pod("b")
    time.sleep(1.0)
    pods.kill_pod("c")
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": -signal.SIGKILL}, pods.log("a")
    recs = pods.records("a")
    regroups = [(r["gen"], r["world_size"], r["reason"], r["node"]) for r in recs
                if r["event"] == "regroup" and r["time"] > killed_at]
    print(f"after the two kills: {regroups}")
    assert regroups and regroups[-1][1] == 1, regroups
    first_alone = next(r for r in recs if r["event"] == "step" and r["time"] > killed_at
                       and r["world_size"] == 1)
    print(f"first step at world 1 {first_alone['time'] - killed_at:.2f} s after the first kill")
    steps = {r["step"] for r in pods.all_records() if r["event"] == "step"}
    assert steps == set(range(1, 81))


def test_two_pods_killed_below_min_replicas_the_survivor_saves_its_step_alone(
        pods: Pods) -> None:
    """min 2: b's pod and, 1 s later, c's are SIGKILLed, so a alone is below the smallest
    world. Its group is gone, but its state at its committed step is the newest anywhere: a
    saves that step alone (a world of one), its worker restarts in place, and the replacements
    b2 and c2 start the next generation with it from that save. No periodic checkpoint: without
    the save alone the job would start over from step 0 (and did: e2e scenario 14 in InProcess
    mode resumed from the last periodic checkpoint)."""
    for node in ("a", "b", "c"):
        pods.start(node, 3, MIN_REPLICAS="2", **NO_PERIODIC)
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 3", timeout=180)
    first = pods.worker_pid("a")
    killed_at = time.time()
    pods.kill_pod("b")
    time.sleep(1.0)
    pods.kill_pod("c")
    wait_for(lambda: pods.worker_pid("a") not in (None, first), "a's worker restarted")
    assert pods.procs["a"].poll() is None, pods.log("a")  # in place: the pod did not end
    stopped = stopping_step(pods, ("a",))
    stops = [r for r in pods.records("a") if r["event"] == "stopping"]
    assert stops[0]["alone"] is True, stops
    saved = [r for r in pods.records("a") if r["event"] == "checkpoint_saved"]
    assert [r["step"] for r in saved] == [stopped], saved
    print(f"a saved step {stopped} alone, committed {saved[0]['time'] - killed_at:.2f} s "
          "after the first kill")
    resume_with_replacements(pods, ("b2", "c2"), 3)
    codes = {n: pods.procs[n].wait(timeout=240) for n in ("a", "b2", "c2")}
    assert set(codes.values()) == {0}, {n: pods.log(n) for n in codes}
    # Steps b or c trained past `stopped` were never committed by a: they are trained again
    # (at most the one step in flight at the second loss, as the no-notice goal allows).
    resumed = [r for r in pods.all_records() if r["event"] == "resumed"]
    assert resumed and {r["step"] for r in resumed} == {stopped}, resumed
    trained = [r["step"] for r in pods.all_records() if r["event"] == "step"]
    assert sorted(set(trained)) == list(range(1, 81)), trained
    retrained = len(trained) - 80
    assert retrained <= 1, trained
    print(f"steps trained again: {retrained}")


def serve(port: int) -> subprocess.Popen[bytes]:
    """The job's store as a process of its own (the store pod's program), empty."""
    proc = subprocess.Popen(rdzv_store.command("127.0.0.1", port),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: MembershipStore.reachable("127.0.0.1", port), "the store")
    return proc


def c_joins_and_all_finish(pods: Pods, pids: dict[str, int | None]) -> dict[str, int]:
    """c joins a's and b's world (world 3) and they keep their worker processes; then every
    pod's exit code."""
    wait_for(lambda: any(r["event"] == "regroup" and r["reason"] == "join"
                         and r["world_size"] == 3 for r in pods.all_records()),
             "c joins at world 3", timeout=180)
    assert {n: pods.worker_pid(n) for n in ("a", "b")} == pids  # no worker restarted
    return pods.wait_all()


def test_the_store_lost_and_back_empty_training_goes_on_and_the_next_join_works(
        tmp_path: Path) -> None:
    """The job's store is a process of its own here (the store pod's program), SIGKILLed while
    a and b train and started again, empty, on the same port. Training goes on meanwhile (the
    process group needs no store); the heartbeat threads notice, reconnect when it answers, and
    the coordinator restores the current generation into it (section 7: the epoch changed), so
    a pod that joins afterwards is planned in as usual: world 3."""
    port = free_port()
    store = serve(port)
    pods = Pods(tmp_path, port, "store-lost")
    try:
        for node in ("a", "b"):
            pods.start(node, 2, MAX_REPLICAS="3", STEPS="200")
        wait_for(lambda: pods.stepped() >= 10, "step 10 at world 2", timeout=180)
        pids = {n: pods.worker_pid(n) for n in ("a", "b")}
        store.kill()
        store.wait()
        at_loss = pods.stepped()
        wait_for(lambda: sum(r["event"] == "store_lost" for r in pods.all_records()) == 2,
                 "both nodes notice the loss")
        wait_for(lambda: pods.stepped() >= at_loss + 10, "10 more steps without a store")
        store = serve(port)
        wait_for(lambda: any(r["event"] == "store_restored" for r in pods.all_records()),
                 "the coordinator restores the generation")
        pods.start("c", 3, MAX_REPLICAS="3", STEPS="200")
        codes = c_joins_and_all_finish(pods, pids)
    finally:
        pods.kill_all()
        store.kill()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    join = next(r for r in pods.all_records() if r["event"] == "regroup"
                and r["reason"] == "join")
    assert join["world_size"] == 3, join
    steps = [r["step"] for r in pods.all_records() if r["event"] == "step"]
    assert steps == list(range(1, 201)), steps  # every step once, with or without a store


def newest_commit(root: Path) -> int:
    """The step of the newest commit under `root`, the one a resume loads: not the newest step
    directory, which may hold a save that its pod never committed (an async save still writing
    when the pod ended)."""
    newest = scan(LocalStorage(root)).newest
    assert newest is not None, sorted(p.name for p in root.iterdir())
    return newest.step


def store_back_first_for_a_new_pod(tmp_path: Path, run: str) -> tuple[
        Pods, TcpProxy, subprocess.Popen[bytes], int]:
    """a and b reach the store through a proxy, c directly. The store is SIGKILLed at step 10
    with the proxy cut, and comes back (empty) while a and b still cannot reach it; c starts
    and registers in it first. Returns the pods, the proxy (cut), the store and its port."""
    port = free_port()
    store = serve(port)
    proxy = TcpProxy("127.0.0.1", port).start()
    pods = Pods(tmp_path, proxy.port, run)
    for node in ("a", "b"):
        (tmp_path / f"{node}.termination").touch()  # as Kubernetes creates it
        pods.start(node, 2, MAX_REPLICAS="3", STEPS=LATE_JOINER_STEPS)
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 2", timeout=180)
    store.kill()
    store.wait()
    proxy.cut()
    wait_for(lambda: sum(r["event"] == "store_lost" for r in pods.all_records()) == 2,
             "both nodes notice the loss")
    store = serve(port)
    pods.start("c", 3, port=port, MAX_REPLICAS="3", STEPS=LATE_JOINER_STEPS)
    new = MembershipStore.connect("127.0.0.1", port, run)
    wait_for(lambda: new.kv.check(["node/c"]), "c registered in the new store", timeout=120)
    return pods, proxy, store, port


def test_a_pod_that_reaches_the_empty_store_before_the_world_waits_for_it_and_joins(
        tmp_path: Path) -> None:
    """The store comes back empty, and a new pod (c) reaches it before the training world
    does (a and b reconnect through a proxy, opened only once c registered). c waits the
    heartbeat timeout for a claim before it founds the store; a and b claim it (keep) within
    a beat of reaching it, so c waits for their restore and joins their world: world 3, same
    worker PIDs, every step once. Seen failing with no wait before founding: c founds the
    store at once, a and b find it founded and end their pods, and c trains alone from the
    checkpoint of step 60 after its start wait (no world-3 join within 180 s)."""
    run = "store-race-kept"
    pods, proxy, store, _ = store_back_first_for_a_new_pod(tmp_path, run)
    try:
        pids = {n: pods.worker_pid(n) for n in ("a", "b")}
        proxy.heal()
        codes = c_joins_and_all_finish(pods, pids)
    finally:
        pods.kill_all()
        proxy.cut()
        store.kill()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    recs = pods.all_records()
    # c notes the claim it waits on (store_kept) unless a and b restored their generation
    # between two of its polls (seen on 2 busy cores): either way nobody founded the store.
    kept = [r for r in recs if r["event"] == "store_kept"]
    assert all(r["node"] == "c" and r["by"] in ("a", "b") for r in kept), kept
    assert not [r for r in recs if r["event"] == "store_founded"]
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == list(range(1, int(LATE_JOINER_STEPS) + 1)), steps  # every step once


def test_a_store_founded_before_the_world_reconnects_ends_the_world_never_two(
        tmp_path: Path) -> None:
    """As above, but a and b reach the store only after c founded it (their reconnect later
    than the heartbeat timeout: by the protocol's own rule, nodes that silent are gone). They
    must not restore into it beside c's start generation: both end their pods at the same
    step boundary as a lost store does (exit 1, RendezvousConnectionError), and their
    replacements start with c from the newest checkpoint. Seen failing when the world
    restores whatever store it finds: a and b trained on beside c's start generation (still
    running 60 s after they reached the store)."""
    run = "store-race-founded"
    pods, proxy, store, port = store_back_first_for_a_new_pod(tmp_path, run)
    try:
        new = MembershipStore.connect("127.0.0.1", port, run)
        wait_for(lambda: new.epoch() is not None, "c founds the store", timeout=30)
        assert new.epoch() == m.Epoch(False, "c", new.epoch().nonce)  # type: ignore[union-attr]
        proxy.heal()
        codes = {n: pods.procs[n].wait(timeout=60) for n in ("a", "b")}
        ended = {n: (tmp_path / f"{n}.termination").read_text() for n in ("a", "b")}
        newest = newest_commit(tmp_path / "ckpt")
        for node in ("a2", "b2"):
            pods.start(node, 3, port=port, MAX_REPLICAS="3", STEPS=LATE_JOINER_STEPS)
        rest = {n: pods.procs[n].wait(timeout=240) for n in ("c", "a2", "b2")}
    finally:
        pods.kill_all()
        proxy.cut()
        store.kill()
    assert codes == {"a": 1, "b": 1}, {n: pods.log(n) for n in codes}
    assert all("RendezvousConnectionError" in t and "founded" in t for t in ended.values()), ended
    recs = pods.all_records()
    founded = [r for r in recs if r["event"] == "store_founded"]
    assert founded and {r["by"] for r in founded} == {"c"}, founded
    last_old = max(r["step"] for n in ("a", "b") for r in pods.records(n) if r["event"] == "step")
    print(f"a and b ended at step {last_old}; newest checkpoint {newest}")
    assert rest == {"c": 0, "a2": 0, "b2": 0}, {n: pods.log(n) for n in rest}
    resumed = [r for r in recs if r["event"] == "resumed"]
    assert resumed and {r["step"] for r in resumed} == {newest}, resumed
    starts = [r for r in recs if r["event"] == "regroup" and r["reason"] == "start"
              and r["time"] > founded[0]["time"]]
    assert starts and {r["world_size"] for r in starts} == {3}, starts


def test_a_loss_while_the_store_is_away_ends_the_pod_as_a_lost_rendezvous_does(
        tmp_path: Path) -> None:
    """The store is gone and b's pod dies: a cannot regroup without the store. Its launcher
    ends the pod at once (exit 1, termination message naming RendezvousConnectionError, which
    the operator counts as the platform's loss and replaces), never waiting on the store; the
    replacements, once a store is back, resume from the newest checkpoint."""
    port = free_port()
    store = serve(port)
    pods = Pods(tmp_path, port, "store-away")
    try:
        for node in ("a", "b"):
            (tmp_path / f"{node}.termination").touch()  # as Kubernetes creates it
            pods.start(node, 2)
        # A commit first (step 12 reached did not say it on a loaded machine: the async upload
        # of step 10 was still in flight when a's pod ended, and nothing was left to resume).
        wait_for(lambda: pods.stepped() >= 12
                 and scan(LocalStorage(tmp_path / "ckpt")).newest is not None,
                 "step 12 and a committed checkpoint", timeout=180)
        store.kill()
        store.wait()
        wait_for(lambda: sum(r["event"] == "store_lost" for r in pods.all_records()) == 2,
                 "both nodes notice the loss")
        lost_at = time.monotonic()
        pods.kill_pod("b")
        code = pods.procs["a"].wait(timeout=60)
        ended_s = time.monotonic() - lost_at
        message = (tmp_path / "a.termination").read_text()
        assert code == 1, pods.log("a")
        assert "RendezvousConnectionError" in message, message
        print(f"b killed with the store away -> a's pod ended in {ended_s:.2f} s: {message}")
        newest = newest_commit(tmp_path / "ckpt")
        store = serve(port)
        for node in ("a2", "b2"):
            pods.start(node, 2)
        codes = {n: pods.procs[n].wait(timeout=240) for n in ("a2", "b2")}
    finally:
        pods.kill_all()
        store.kill()
    assert codes == {"a2": 0, "b2": 0}, {n: pods.log(n) for n in codes}
    resumed = [r for r in pods.all_records() if r["event"] == "resumed"]
    assert [r["step"] for r in resumed] == [newest], resumed
