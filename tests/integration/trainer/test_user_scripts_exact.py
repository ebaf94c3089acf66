"""A user's script trains exactly through world changes (issue 32): user_script_exact.py, a
DistributedSampler + DataLoader + accumulation + LR schedule + EMA script with a torch.compile'd
model and an evaluation loop over a second DistributedSampler, under elastrain's launcher,
first with in-process recovery, then in restart mode with the same world changes at the same
steps, and the two runs end bit-identical.

In process (test_inprocess_launcher's pods, one real TCPStore, DataLoader workers=2): a and b
start at world 2 (global batch 8 = batch_size 4 x 2 ranks x accum 1); b is SIGTERMed in step 6
and leaves at its end (world 1, accum 2); c joins at the end of step 9 (world 2); c's worker is
SIGKILLed in step 13, which a redoes alone (world 1: its all-reduce failed); d joins at the end
of step 16 (world 2) to step 24. 96 samples make an epoch of 12 steps, so the loss redoes the
first step of epoch 1 (its pass opened in the undone attempt).

Restart mode (LocalCluster's torchrun agents on a c10d store, file:// checkpoints, workers=0):
the same world per step, each change a save and a restart: an agent preempted in step 6 (and in
step 12, the in-process loss's last committed step) saves and its peer resumes alone; an agent
added while the survivor waits in step 9 (and 16) makes it save at that step's end and both
resume at world 2.

Every change is placed by the script's hold (TEST_HOLD_AT): the ranks wait at the step's start
until the test has made the change's cause happen (a notice received, a join request in the
store, a worker killed) and released it.

Why bit-identical is the right bar: both runs train each step at the same world size, so each
rank reads the same positions of the same epoch order (rank r: positions r, r + W, ...), forms
the same micro-batches, and the gradients are combined in the same order: at world 1 two
micro-batches accumulated by autograd in order; at world 2 DDP's all-reduce of two tensors,
whose gloo sum is a + b = b + a exactly (whichever node holds rank 0). The DataLoader's workers
only move the same batches between processes. Any other difference (a sample read twice or
skipped, a schedule or EMA not carried over, AdamW's state or step count not healed, a step
redone on top of its undone attempt) changes the weights.
"""

from __future__ import annotations

import collections
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from elastrain_trainer.inprocess.store import MembershipStore
from elastrain_trainer.launch import cluster as cluster_module
from elastrain_trainer.launch.cluster import LocalCluster

from .conftest import load_checkpoint, trainer_env
from .test_elastic import assert_identical
from .test_inprocess import wait_for
from .test_inprocess_launcher import Pods, job_store, pods
from .user_script_exact import (
    BASE_LR,
    EVAL_EVERY,
    EVAL_SAMPLES,
    MICRO,
    SAMPLES,
    SEED,
    dataset,
    lr_factor,
)

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(300)]
__all__ = ["job_store", "pods"]  # the fixtures, imported for the test below
SCRIPT = Path(__file__).with_name("user_script_exact.py")
STEPS = 24
GLOBAL_BATCH = 8  # the loader's batch_size 4 x ELASTRAIN_REPLICAS 2
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
# The world changes (the last step at the old world, the new world), in both modes.
CHANGES = [(6, 1), (9, 2), (12, 1), (16, 2)]
# Both modes: no periodic checkpoint (restart mode resumes from the stops' saves), no pacing.
# The job's spec.trainer batch agrees with the script's loader (a set one that did not would be
# refused at the first step: test_loader_positions.py).
COMMON: dict[str, Any] = {"STEPS": str(STEPS), "CHECKPOINT_INTERVAL_STEPS": "1000",
                          "CHECKPOINT_KEEP": "100", "STEP_SLEEP_SECONDS": "0",
                          "GLOBAL_BATCH_SIZE": str(GLOBAL_BATCH), "MICRO_BATCH_SIZE": str(MICRO)}


# -- what the script wrote -----------------------------------------------------------------------

def read_records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(out.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.endswith("}")]


def trained(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Each step's records, by rank, of the attempt that counted. A step redone after a lost
    peer was recorded first at the old world (by the survivor, and by the lost node if it got
    that far); the redo, later and at the smaller world, is the one whose update was applied."""
    per_step: dict[int, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    for r in sorted((r for r in read_records(out) if r["event"] == "step"),
                    key=lambda r: r["time"]):
        per_step[r["step"]][r["pid"]] = r  # a process's later record of the step wins
    steps = {}
    for step, by_pid in per_step.items():
        world = max(by_pid.values(), key=lambda r: r["time"])["world"]
        steps[step] = sorted((r for r in by_pid.values() if r["world"] == world),
                             key=lambda r: r["rank"])
    return steps


def changes_of(steps: dict[int, list[dict[str, Any]]]) -> list[tuple[int, int]]:
    worlds = [steps[s][0]["world"] for s in range(1, STEPS + 1)]
    return [(s, worlds[s]) for s in range(1, STEPS) if worlds[s] != worlds[s - 1]]


def epoch_positions(epoch: int) -> list[int]:
    """torch's own DistributedSampler order of the epoch (one rank: no padding, no split)."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset(), num_replicas=1, rank=0,
                                                          shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def assert_exact(steps: dict[int, list[dict[str, Any]]]) -> None:
    """Every step once with one record per rank; each step's samples are the next global batch
    of the epoch's order (so every index once per epoch); the LR is the schedule's; the
    script's sub-group and its GradScaler follow the world."""
    assert sorted(steps) == list(range(1, STEPS + 1)), sorted(steps)
    for step, recs in steps.items():
        world = recs[0]["world"]
        assert [r["rank"] for r in recs] == list(range(world)), (step, recs)
        assert {r["accum"] for r in recs} == {GLOBAL_BATCH // (MICRO * world)}, (step, recs)
        read = [i for r in recs for i in r["indices"]]
        assert len(read) == GLOBAL_BATCH, (step, world, read)  # the global batch, every step
        epoch, at = divmod((step - 1) * GLOBAL_BATCH, SAMPLES)
        assert {r["epoch"] for r in recs} == {epoch}, (step, recs)
        assert sorted(read) == sorted(epoch_positions(epoch)[at:at + GLOBAL_BATCH]), (
            step, world, read)
        want_lr = BASE_LR * lr_factor(step - 1)
        assert {r["lr"] for r in recs} == {want_lr}, (step, want_lr, recs)
        # The script's sub-group, rebuilt in on_world_change, spans the current world; the
        # GradScaler's scale is one value across ranks (a joiner's included).
        assert {r["group"] for r in recs} == {world}, (step, recs)
        assert len({r["scale"] for r in recs}) == 1, (step, recs)
        # The evaluation loader (built second) is re-split too: every held-out sample once.
        scores = {tuple(r["eval"]) if r["eval"] else None for r in recs}
        assert len(scores) == 1, (step, recs)
        if step % EVAL_EVERY == 0:
            assert next(iter(scores))[1] == EVAL_SAMPLES, (step, scores)
    for epoch in range(STEPS // STEPS_PER_EPOCH):
        span = range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
        counts = collections.Counter(i for s in span for r in steps[s] for i in r["indices"])
        assert counts == collections.Counter(range(SAMPLES)), (epoch, counts)


def finals(out: Path) -> list[tuple[Any, ...]]:
    """Each rank's digests of its model, EMA and AdamW state at the end, and its schedule's
    step count: what the last world's ranks hold (a joiner's healed state included)."""
    recs = [r for r in read_records(out) if r["event"] == "final"]
    assert sorted(r["rank"] for r in recs) == [0, 1], recs
    return [(r["model"], r["ema"], r["adam"], r["last_epoch"]) for r in recs]


def wait_held(out: Path, step: int, world: int,
              ended: Callable[[], str | None]) -> list[dict[str, Any]]:
    """The `world` ranks waiting at the start of `step` (the script's hold); fails at once
    with `ended()`, the log of what ended meanwhile (the script crashed), if it says any."""
    def held() -> list[dict[str, Any]]:
        return [r for r in read_records(out) if r["event"] == "held" and r["step"] == step
                and r["world"] == world]

    def ready() -> bool:
        log = ended()
        assert log is None, f"ended before step {step} was held: {log}"
        return len({r["pid"] for r in held()}) == world

    wait_for(ready, f"{world} rank(s) held at step {step}", timeout=180)
    return held()


def release(out: Path, step: int) -> None:
    (out / f"release-{step}").touch()


def wait_noticed(out: Path, held: list[dict[str, Any]]) -> None:
    wait_for(lambda: any((out / f"sigterm-{r['pid']}").exists() for r in held),
             "the SIGTERM in a held rank", timeout=60)


def final(out: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(out / "final.pt", weights_only=True)
    return state


# -- the two runs -------------------------------------------------------------------------------

@pytest.fixture
def records_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the in-process pods' scripts write (the pods inherit this process's env)."""
    out = tmp_path / "records"
    out.mkdir()
    monkeypatch.setenv("TEST_RECORDS", str(out))
    return out


def run_in_process(pods: Pods, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_HOLD_AT", "6,9,13,16")
    monkeypatch.setenv("TEST_LOADER_WORKERS", "2")
    monkeypatch.setenv("TEST_COMPILE", "1")  # a torch.compile'd model, in both runs
    entry = (str(SCRIPT),)
    for node in ("a", "b"):
        pods.start(node, 2, entry=entry, **COMMON)
    store = MembershipStore.connect("127.0.0.1", pods.port, pods.run)

    def ended() -> str | None:  # a trains throughout
        return pods.log("a") if pods.procs["a"].poll() is not None else None

    def joined(node: str) -> None:
        wait_for(lambda: node in store.joins_after(0)[1], f"{node}'s join request",
                 timeout=180)

    held = wait_held(out, 6, 2, ended)
    pods.procs["b"].send_signal(signal.SIGTERM)  # the kubelet signals the pod's PID 1 only
    wait_noticed(out, [r for r in held if r["node"] == "b"])
    release(out, 6)  # b leaves at the end of step 6
    wait_held(out, 9, 1, ended)
    pods.start("c", 2, entry=entry, **COMMON)
    joined("c")
    release(out, 9)  # the coordinator sees the request at the end of step 9
    held = wait_held(out, 13, 2, ended)
    os.kill(next(r["pid"] for r in held if r["node"] == "c"), signal.SIGKILL)  # no notice
    release(out, 13)  # a's all-reduce in step 13 fails: step 13 redone at world 1
    wait_held(out, 16, 1, ended)
    pods.start("d", 2, entry=entry, **COMMON)
    joined("d")
    release(out, 16)
    codes = pods.wait_all(timeout=180)
    assert codes["a"] == codes["b"] == codes["d"] == 0, {n: pods.log(n) for n in codes}
    assert codes["c"] != 0, pods.log("c")  # its worker's SIGKILL: a crash, the pod ends


def run_restart_mode(root: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**trainer_env(root, **COMMON), "TEST_RECORDS": str(out), "TEST_LOADER_WORKERS": "0",
           "TEST_COMPILE": "1",
           "TEST_HOLD_AT": ",".join(str(step) for step, _ in CHANGES)}
    # The first round must hold both agents (a world of 2 from step 1): they start together,
    # but one may reach the store seconds after the other on a loaded machine. Later agents
    # (and their rounds at world 1) keep the default 1 s.
    default = cluster_module.RDZV_CONF
    monkeypatch.setattr(cluster_module, "RDZV_CONF", default.replace(
        "last_call_timeout=1", "last_call_timeout=5"))
    cluster = LocalCluster(env, 1, 2, root / "logs", job_id=root.name, entry=(str(SCRIPT),),
                           on_record=lambda agent, r: None)
    try:
        cluster.start(2)
        monkeypatch.setattr(cluster_module, "RDZV_CONF", default)

        def ended() -> str | None:  # every agent gone
            if any(a.proc.poll() is None for a in cluster.agents):
                return None
            return cluster.agents[-1].log_path.read_text(errors="replace")[-3000:]

        world = 2
        for step, new_world in CHANGES:
            held = wait_held(out, step, world, ended)
            if new_world < world:  # a leave: the oldest live agent's notice
                cluster.preempt(next(a for a in cluster.agents if a.proc.poll() is None))
            else:  # a join: the survivor's agent stops its worker for the new round
                cluster.add_agent()
            wait_noticed(out, held)
            release(out, step)  # the stop's save is of this step
            world = new_world
        codes = cluster.wait_agents(timeout=180)
    finally:
        cluster.stop()
    logs = {a.name: a.log_path.read_text(errors="replace")[-3000:] for a in cluster.agents}
    assert [codes[a.name] for a in cluster.agents[-2:]] == [0, 0], (codes, logs)
    resumed = [(r["step"], r["world_size"]) for _, r in cluster.records
               if r["event"] == "resumed"]
    assert sorted(set(resumed)) == CHANGES, resumed


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The restart-mode run, once for every loader family (all read the same batches): its
    root, with records/ and ckpt/."""
    root = tmp_path_factory.mktemp("restart")
    out = root / "records"
    out.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        run_restart_mode(root, out, mp)
    restarted = trained(out)
    assert_exact(restarted)
    assert changes_of(restarted) == CHANGES, changes_of(restarted)
    return root


@pytest.mark.parametrize("family", ["distributed", "elastic", "stateful"])
def test_a_users_script_trains_exactly_through_a_leave_joins_and_a_loss_in_process_as_restarts_do(
        pods: Pods, records_dir: Path, tmp_path: Path, reference: Path, family: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Per loader family: torch's DistributedSampler + DataLoader, the Session's ElasticSampler,
    torchdata's StatefulDataLoader (0.11.0, the newest, on the pinned torch)."""
    monkeypatch.setenv("TEST_LOADER", family)
    run_in_process(pods, records_dir, monkeypatch)
    # The survivors kept their worker processes: one process (one records file) per node.
    files = collections.Counter(p.name.split("-")[0] for p in records_dir.glob("*.jsonl"))
    assert files == {"a": 1, "b": 1, "c": 1, "d": 1}, files
    steps = trained(records_dir)
    assert_exact(steps)
    assert changes_of(steps) == CHANGES, changes_of(steps)
    regroups = {r["gen"]: (r["reason"], r["world_size"]) for r in pods.all_records()
                if r["event"] == "regroup"}
    assert [regroups[g] for g in sorted(regroups)] == [
        ("start", 2), ("leave", 1), ("join", 2), ("fail", 1), ("join", 2)], regroups
    redone = [r for r in read_records(records_dir) if r["event"] == "step" and r["step"] == 13]
    assert [(r["node"], r["world"]) for r in redone] == [("a", 2), ("a", 1)], redone

    restart_out = reference / "records"
    restarted = trained(restart_out)
    evals = {s: steps[s][0]["eval"] for s in steps if s % EVAL_EVERY == 0}
    assert evals == {s: restarted[s][0]["eval"] for s in restarted if s % EVAL_EVERY == 0}
    in_process = finals(records_dir)
    assert len(set(in_process)) == 1 and set(in_process) == set(finals(restart_out)), (
        in_process, finals(restart_out))
    in_process_final, restarted_final = final(records_dir), final(restart_out)
    assert_identical(restarted_final, in_process_final, "final.pt")
    # And the rest of the final checkpoint: AdamW's moments and step, the schedule, the EMA.
    want = load_checkpoint(reference / "ckpt", STEPS, tmp_path)
    got = load_checkpoint(pods.root / "ckpt", STEPS, tmp_path)
    assert set(got) == {"model", "optimizer", "scheduler", "ema", "scaler", "elastrain"}, set(got)
    for part in sorted(got):
        assert_identical(want[part], got[part], part)
