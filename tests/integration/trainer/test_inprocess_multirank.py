"""In-process recovery with two ranks per pod (nprocPerNode 2, issue 35 item 1), under the
launcher as the operator renders an InProcess pod (torchrun standalone, PET_NPROC_PER_NODE=2)
against one real TCPStore: 3 pods, world 6 (min 2 pods).

- a SIGTERM to one pod (its notice): both its ranks leave at the same step boundary, the other
  four ranks keep their processes and train on at world 4, every step once; a pod started
  later joins whole and the world is 6 again, its ranks healed from the same local ranks of a
  live pod;
- with a spare pod (replicas 2, spares 1: world 4), a member pod SIGKILLed (no notice): the
  spare's two ranks take its place in one plan, healed from the same local ranks of the
  survivor, and the lost pod is counted once (not once per rank);
- one local rank of a pod killed: its pod fails as a whole, once, and the survivors go on;
- FSDP2 over two pods: a leaving pod's two ranks hand their shards to the other pod's;
- exact resume: the surviving pod's final state equals the same schedule done by restart.

Few scenarios, long enough steps: six trainer processes on two cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.ports import free_port

from .conftest import load_checkpoint
from .test_elastic import assert_identical
from .test_inprocess import wait_for
from .test_inprocess_builtin import base_env, job_store, records
from .test_inprocess_launcher import HEARTBEAT_S, Pods, progress

pytestmark = [pytest.mark.timeout(420)]
__all__ = ["job_store"]  # the fixture, imported for the tests below
STEPS = "80"
# The joining pod starts after the leave and must import torch before the others finish.
JOIN_STEPS = "140"
# 24 / (2 * 6) and 24 / (2 * 4): whole micro-batches at 3 pods and at 2.
POD = {"PET_NPROC_PER_NODE": "2", "GLOBAL_BATCH_SIZE": "24", "MICRO_BATCH_SIZE": "2",
       "MIN_REPLICAS": "2", "STEPS": STEPS, "STEP_SLEEP_SECONDS": "0.15"}


class MultiRankPods(Pods):
    def signal_pod(self, node: str, sig: signal.Signals) -> None:
        """`sig` to every process of the pod: each local rank's session (torch starts each
        worker in one of its own), the launcher's group and a warm start's shims."""
        for group in (*self.worker_pids(node), self.launcher_pid(node), self.procs[node].pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)

    def regroups(self, reason: str) -> list[dict[str, Any]]:
        return [r for r in self.all_records() if r["event"] == "regroup"
                and r["reason"] == reason]


@pytest.fixture
def pods(job_store: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pods]:
    p = MultiRankPods(tmp_path, job_store.port, request.node.name[:40])
    yield p
    p.kill_all()


def start_three(pods: MultiRankPods, ports: dict[str, int] | None = None, replicas: int = 3,
                **extra: str) -> dict[str, list[int]]:
    """Pods a, b, c; the world is `replicas` of them (6 ranks at 3, 4 at 2 with a spare)."""
    for node in ("a", "b", "c"):
        port = {"METRICS_PORT": str(ports[node])} if ports and node in ports else {}
        pods.start(node, replicas, **{**POD, **port, **extra})
    wait_for(lambda: pods.stepped() >= 10, "step 10 at full size", timeout=240)
    pids = {n: pods.worker_pids(n) for n in pods.procs}
    assert all(len(p) == 2 for p in pids.values()), pids
    starts = pods.regroups("start")
    assert {r["world_size"] for r in starts} == {2 * replicas}, starts
    return pids


def steps_and_worlds(pods: Pods) -> list[tuple[int, int]]:
    return [(r["step"], r["world_size"]) for r in pods.all_records() if r["event"] == "step"]


def test_a_pod_leaves_with_both_ranks_and_a_new_pod_joins_whole(pods: MultiRankPods) -> None:
    pids = start_three(pods, MAX_REPLICAS="3", STEPS=JOIN_STEPS)
    pods.procs["c"].send_signal(signal.SIGTERM)  # the kubelet signals the pod's PID 1 only
    wait_for(lambda: pods.regroups("leave"), "the regroup after the leave")
    leave = pods.regroups("leave")
    assert {r["world_size"] for r in leave} == {4}, leave
    assert pods.procs["c"].wait(timeout=120) == 0, pods.log("c")
    left = [r for r in pods.records("c") if r["event"] == "left"]
    assert len(left) == 2 and len({r["step"] for r in left}) == 1, left  # both ranks, together
    pods.start("d", 3, **{**POD, "MAX_REPLICAS": "3", "STEPS": JOIN_STEPS})
    wait_for(lambda: pods.regroups("join"), "the joining pod's regroup", timeout=180)
    survivors = {n: pods.worker_pids(n) for n in ("a", "b")}
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, {n: pods.log(n) for n in codes}
    assert survivors == {n: pids[n] for n in ("a", "b")}  # no rank restarted, leave or join
    joined = [r for r in pods.records("d") if r["event"] == "regroup" and r["reason"] == "join"]
    # Each of d's ranks healed from the same local rank of a live pod.
    assert sorted((r["node"], r["healed_from"]) for r in joined) in (
        [("d/0", f"{p}/0"), ("d/1", f"{p}/1")] for p in ("a", "b")), joined
    assert {r["world_size"] for r in joined} == {6}
    steps = steps_and_worlds(pods)
    assert [s for s, _ in steps] == list(range(1, int(JOIN_STEPS) + 1)), steps  # each once
    worlds = [w for _, w in steps]
    assert worlds[0] == 6 and 4 in worlds and worlds[-1] == 6, worlds
    assert set(worlds) == {6, 4}


def test_a_pod_killed_without_notice_is_one_loss_and_a_spare_pod_takes_its_place_whole(
        pods: MultiRankPods) -> None:
    """spec.spares 1 with two pods in the world: the spare pod's two ranks wait, torch
    imported; when a member pod is killed they take its place in one plan, each healed from
    the same local rank of the surviving pod (no checkpoint load), and the loss is one pod."""
    ports = {n: free_port() for n in ("a", "b", "c")}
    pids = start_three(pods, ports, replicas=2, SPARES="1", MAX_REPLICAS="3")
    spare = {r["node"].partition("/")[0] for r in pods.all_records() if r["event"] == "spare"}
    assert len(spare) == 1, spare
    victim, survivor = [n for n in ("a", "b", "c") if n not in spare]
    killed_at = time.time()
    pods.kill_pod(victim)
    wait_for(lambda: [r for r in pods.regroups("fail") if r["node"] == f"{survivor}/0"],
             "the survivor's regroup after the loss")
    kept = pods.worker_pids(survivor)
    # The generation the loss made: not a fixed number, as the spare pod's ranks, registering
    # after the world started, each move the generation on (a kept plan; CI at 2cf0352 waited
    # for generation 2 here while the loss made 4, until the job ended under its poll).
    (gen,) = {r["gen"] for r in pods.regroups("fail") if r["node"] == f"{survivor}/0"}
    wait_for(lambda: progress(ports[survivor])["generation"] == gen, f"generation {gen} on "
             "/progress")
    lost = progress(ports[survivor])["plannedOut"]
    codes = pods.wait_all()
    assert codes[survivor] == 0 and codes[victim] == -signal.SIGKILL, {
        n: pods.log(n) for n in codes}
    assert kept == pids[survivor]  # no rank restarted
    assert list(lost) == [victim], lost  # one pod planned out, not one per rank
    fail = pods.regroups("fail")
    assert {r["world_size"] for r in fail} == {4}, fail
    (taken,) = spare
    healed = sorted((r["node"], r["healed_from"]) for r in fail if r["node"].startswith(taken))
    assert healed == [(f"{taken}/{i}", f"{survivor}/{i}") for i in range(2)], fail
    assert not any(r["event"] == "resumed" for r in pods.all_records())
    took = min(r["time"] for r in fail) - killed_at
    print(f"pod of 2 ranks killed -> its spare pod in at world 4 in {took:.2f} s")
    assert took <= HEARTBEAT_S + 4.0, took
    steps = steps_and_worlds(pods)
    assert {w for _, w in steps} == {4}, steps  # never below the desired world
    assert sorted({s for s, _ in steps}) == list(range(1, int(STEPS) + 1))
    assert len(steps) - len({s for s, _ in steps}) <= 1


def test_one_local_rank_lost_fails_its_pod_as_a_whole_once(pods: MultiRankPods) -> None:
    """The pod's other rank does not train on beside the world: its launcher ends the pod (a
    crash, counted by the operator), and the world goes on at 4 without either rank."""
    port = free_port()
    pids = start_three(pods, {"a": port})
    victim = pids["c"][1]
    os.killpg(victim, signal.SIGKILL)  # one rank's process (and its session) only
    wait_for(lambda: pods.regroups("fail"), "the regroup after the loss")
    survivors = {n: pods.worker_pids(n) for n in ("a", "b")}
    wait_for(lambda: progress(port)["generation"] == 2, "generation 2 on a's /progress")
    lost = progress(port)["plannedOut"]
    codes = pods.wait_all()
    assert codes["a"] == 0 and codes["b"] == 0, {n: pods.log(n) for n in codes}
    # The pod failed once, as a crash of its launcher (what the operator counts), and its
    # live rank left the world: dropped, not trained on beside it.
    # Which local rank the victim was is not known up front (PIDs need not follow local ranks,
    # CI at c7157c6 killed local rank 0 as the higher PID): the launcher names it.
    crashed = re.findall(r"worker crashed: rank (\d+)", pods.log("c"))
    assert codes["c"] != 0 and len(crashed) == 1, pods.log("c")
    other = 1 - int(crashed[0])
    assert [r["node"] for r in pods.records("c") if r["event"] == "dropped"] == [f"c/{other}"]
    assert list(lost) == ["c"], lost
    assert survivors == {n: pids[n] for n in ("a", "b")}
    fail = pods.regroups("fail")
    assert {r["world_size"] for r in fail} == {4}, fail
    worlds = [w for _, w in steps_and_worlds(pods)]
    assert worlds[0] == 6 and worlds[-1] == 4 and set(worlds) == {6, 4}, worlds
    assert sorted({s for s, _ in steps_and_worlds(pods)}) == list(range(1, int(STEPS) + 1))


def test_fsdp_a_pod_leaves_and_its_two_ranks_hand_their_shards_to_the_survivor(
        pods: MultiRankPods) -> None:
    """FSDP2 over the world's four ranks (two pods): the leaving pod's ranks hand their shards
    over before they exit, and the other pod's two ranks reshard in process (no load, no
    restart)."""
    for node in ("a", "b"):
        pods.start(node, 2, **{**POD, "STRATEGY": "fsdp", "MIN_REPLICAS": "1"})
    wait_for(lambda: pods.stepped() >= 10, "step 10 at world 4", timeout=240)
    pids = {n: pods.worker_pids(n) for n in pods.procs}
    pods.procs["b"].send_signal(signal.SIGTERM)
    wait_for(lambda: pods.regroups("leave"), "the regroup after the leave")
    survivor = pods.worker_pids("a")
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0}, {n: pods.log(n) for n in codes}
    assert len(survivor) == 2 and survivor == pids["a"]
    assert not any(r["event"] == "resumed" for r in pods.all_records())  # no checkpoint load
    steps = steps_and_worlds(pods)
    assert [s for s, _ in steps] == list(range(1, int(STEPS) + 1)), steps
    assert steps[0][1] == 4 and steps[-1][1] == 2 and {w for _, w in steps} == {4, 2}


def rank_processes(root: Path, pod: str, port: int, run: str, replicas: int,
                   **extra: str) -> dict[str, subprocess.Popen[bytes]]:
    """A pod's two ranks as torchrun would start them (LOCAL_RANK, LOCAL_WORLD_SIZE), without
    the launcher, so that each rank's log is its own."""
    return {f"{pod}/{r}": subprocess.Popen(
        [sys.executable, "-m", "elastrain_trainer"],
        env={**base_env(root, **{"STEP_SLEEP_SECONDS": "0.1", **extra}),
             "ELASTRAIN_RECOVERY": "inProcess", "ELASTRAIN_STORE": f"127.0.0.1:{port}",
             "ELASTRAIN_NODE_ID": pod, "ELASTRAIN_RUN_ID": run, "LOCAL_RANK": str(r),
             "LOCAL_WORLD_SIZE": "2", "ELASTRAIN_REPLICAS": str(replicas),
             "ELASTRAIN_HEARTBEAT_TIMEOUT_SECONDS": "2"},
        stdout=(root / f"{pod}-{r}.log").open("wb"), stderr=subprocess.STDOUT)
        for r in range(2)}


def pod_b_leaves_at_step_6(procs: dict[str, subprocess.Popen[bytes]],
                           logs: dict[str, Path]) -> None:
    """Pod b's two ranks get their SIGTERM once step 6 trained (what its launcher forwards);
    every rank then ends 0."""
    try:
        wait_for(lambda: max((r["step"] for n in procs for r in records(logs[n])
                              if r["event"] == "step"), default=0) >= 6, "step 6")
        for node in ("b/0", "b/1"):
            procs[node].send_signal(signal.SIGTERM)
        codes = {n: p.wait(timeout=240) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert set(codes.values()) == {0}, {n: logs[n].read_text()[-3000:] for n in procs}


def test_the_survivor_pod_equals_a_restart_at_the_smaller_world_bit_for_bit(
        job_store: Any, tmp_path: Path) -> None:
    """Two pods of two ranks, pod b leaves with a SIGTERM to both its ranks (what its launcher
    forwards), pod a trains on at world 2 in its processes. The same schedule by restart: four
    restart-mode ranks (LOCAL_RANK 0 and 1 twice) to the leave's step, then a pod of two new
    ranks resuming at world 2 from their checkpoint. The final model, optimizer and trainer
    state are identical."""
    a_root, b_root, pair_root = (tmp_path / n for n in ("inprocess", "restart", "world4"))
    for d in (a_root, b_root, pair_root):
        d.mkdir()
    procs = {**rank_processes(a_root, "a", job_store.port, "ranks-a", 2),
             **rank_processes(a_root, "b", job_store.port, "ranks-a", 2)}
    logs = {n: a_root / f"{n.replace('/', '-')}.log" for n in procs}
    pod_b_leaves_at_step_6(procs, logs)
    left = {r["step"] for n in ("b/0", "b/1") for r in records(logs[n]) if r["event"] == "left"}
    assert len(left) == 1, left
    (step,) = left
    worlds = {r["step"]: r["world_size"] for n in procs for r in records(logs[n])
              if r["event"] == "step"}
    assert sorted(worlds) == list(range(1, 25))
    assert {worlds[s] for s in range(1, step + 1)} == {4}
    assert {worlds[s] for s in range(step + 1, 25)} == {2}

    port = free_port()
    four = [subprocess.Popen(
        [sys.executable, "-m", "elastrain_trainer"],
        env={**base_env(pair_root), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
             "LOCAL_WORLD_SIZE": "2"},
        stdout=(pair_root / f"rank{rank}.log").open("wb"), stderr=subprocess.STDOUT)
        for rank in range(4)]
    assert [p.wait(timeout=240) for p in four] == [0] * 4, (
        (pair_root / "rank0.log").read_text()[-3000:])
    solo = rank_processes(b_root, "solo", job_store.port, "ranks-b", 1,
                          RESUME_FROM=f"file://{pair_root}/ckpt/step-{step:08d}")
    assert [p.wait(timeout=240) for p in solo.values()] == [0, 0], (
        (b_root / "solo-0.log").read_text()[-3000:])
    resumed = next(r for r in records(b_root / "solo-0.log") if r["event"] == "resumed")
    assert resumed["step"] == step and resumed["saved_world_size"] == 4
    want = load_checkpoint(b_root / "ckpt", 24, tmp_path)
    got = load_checkpoint(a_root / "ckpt", 24, tmp_path)
    assert want.keys() == got.keys() and {"model", "optim", "trainer"} <= set(got)
    for part in want:
        assert_identical(want[part], got[part], part)
