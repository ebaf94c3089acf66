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
- FSDP2 over the six ranks: a leaving pod's two ranks hand their shards to the survivors.

Few scenarios, long enough steps: six trainer processes on two cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.ports import free_port
from tests.warmstart import started_pid

from .test_inprocess import wait_for
from .test_inprocess_builtin import job_store
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
    wait_for(lambda: pods.regroups("fail"), "the regroup after the loss")
    kept = pods.worker_pids(survivor)
    wait_for(lambda: progress(ports[survivor])["generation"] == 2, "generation 2 on /progress")
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
    assert codes["c"] != 0 and "worker crashed: rank 1" in pods.log("c"), pods.log("c")
    assert [r["node"] for r in pods.records("c") if r["event"] == "dropped"] == ["c/0"]
    assert list(lost) == ["c"], lost
    assert survivors == {n: pids[n] for n in ("a", "b")}
    fail = pods.regroups("fail")
    assert {r["world_size"] for r in fail} == {4}, fail
    worlds = [w for _, w in steps_and_worlds(pods)]
    assert worlds[0] == 6 and worlds[-1] == 4 and set(worlds) == {6, 4}, worlds
    assert sorted({s for s, _ in steps_and_worlds(pods)}) == list(range(1, int(STEPS) + 1))


def test_fsdp_a_pod_leaves_and_its_two_ranks_hand_their_shards_to_the_survivors(
        pods: MultiRankPods) -> None:
    """FSDP2 over the world's six ranks: the leaving pod's ranks hand their shards over before
    they exit, and the four survivors reshard in process (no load, no restart)."""
    pids = start_three(pods, STRATEGY="fsdp")
    pods.procs["c"].send_signal(signal.SIGTERM)
    wait_for(lambda: pods.regroups("leave"), "the regroup after the leave")
    survivors = {n: pods.worker_pids(n) for n in ("a", "b")}
    codes = pods.wait_all()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: pods.log(n) for n in codes}
    assert survivors == {n: pids[n] for n in ("a", "b")}
    assert not any(r["event"] == "resumed" for r in pods.all_records())  # no checkpoint load
    steps = steps_and_worlds(pods)
    assert [s for s, _ in steps] == list(range(1, int(STEPS) + 1)), steps
    assert steps[0][1] == 6 and steps[-1][1] == 4 and {w for _, w in steps} == {6, 4}
