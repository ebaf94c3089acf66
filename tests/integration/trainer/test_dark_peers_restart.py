"""Restart mode, a node that goes dark (issue 34; session.dark_peers, session.restart_fence):
real torchrun agents against a real rendezvous store, one node frozen whole (SIGSTOP of the
agent and its worker: no beat, no socket closed, as a hung or partitioned host).

The node frozen is the checkpoint coordinator's, stopped right before it commits a save whose
shards are all written (the fault ELASTRAIN_FAULT_FREEZE_BEFORE_COMMIT, then the test stops its
agent too). The survivors' all-reduce would wait out gloo's collective timeout (5 minutes);
instead each survivor's watch finds the frozen rank's heartbeat silent and ends its process as
a lost peer does, torchrun's rendezvous re-forms the group without the frozen node (once its
keep-alive lapses) and it resumes at world 2. Once the new group has committed, the frozen
worker is thawed (its agent stays stopped, so it cannot rejoin): it must not commit its old
step or move `latest` back, and the group re-formed without it names it planned out (the
operator's cue to replace its pod; seen failing with the marks off). Seen failing with the
watch off (`start_dark_peer_watch` returning None: no resume within the wait) and with the
fence off (`watch.fence = None`: the thawed worker's save of step 4 went on to its commit and
ended `checkpoint_failed`, its result's broadcast to the peers that were gone).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.launch.cluster import Agent, LocalCluster, descendants
from tests.warmstart import started_pid

from .conftest import trainer_env
from .test_elastic import records, run_cluster

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(300)]
HEARTBEAT_S = 2.0
STARTS = ("resumed", "fresh_start")  # a group's start (nothing was committed yet: fresh)
SAVE_ENDS = ("checkpoint_fenced", "checkpoint_saved", "checkpoint_failed")


def node_processes(pid: int) -> list[int]:
    """The agent started as `pid` and every process under it, warm starts included (a shim's
    process runs in the fork server's tree: started_pid names it)."""
    out, todo = [], [pid]
    while todo:
        real = started_pid(todo.pop())
        out.append(real)
        todo += [p for p in descendants(real) if p not in out]
    return sorted(set(out))


def test_a_frozen_node_restarts_the_group_by_the_heartbeat_and_commits_nothing_when_it_thaws(
        tmp_path: Path) -> None:
    frozen: dict[str, Any] = {}
    faults = tmp_path / "faults.env"
    faults.write_text("ELASTRAIN_FAULT_FREEZE_BEFORE_COMMIT=1\n"
                      f"ELASTRAIN_FAULT_CRASH_ONCE={tmp_path / 'froze-once'}\n")
    root = tmp_path / "ckpt"

    def freeze_the_coordinator(cluster: LocalCluster) -> None:
        def coordinator() -> Agent | None:
            return next((a for a in cluster.agents if a.log_path.exists()
                         and "injected freeze before the commit" in a.log_path.read_text()),
                        None)

        deadline = time.time() + 180
        while (agent := coordinator()) is None:
            assert time.time() < deadline, "no coordinator froze before its commit"
            time.sleep(0.1)
        pids = node_processes(agent.proc.pid)
        frozen["at"] = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            # Far below the collective timeout (300 s): only the heartbeat's path is this fast.
            assert cluster.wait_for(lambda rs: any(
                r["event"] in STARTS and r["time"] > frozen["at"] for _, r in rs),
                timeout=90), "the survivors never resumed without the frozen node"
            assert cluster.wait_for(lambda rs: any(
                r["event"] == "checkpoint_saved" and r["time"] > frozen["at"] for _, r in rs),
                timeout=90), "the new group never committed"
            # The worker thaws; its agent stays stopped (it must not rejoin before this ends).
            agents = {agent.proc.pid, started_pid(agent.proc.pid)}
            frozen["thawed"] = time.time()
            for pid in pids:
                if pid not in agents:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            assert cluster.wait_for(lambda rs: any(
                name == agent.name and r["event"] in SAVE_ENDS for name, r in rs),
                timeout=20), "the thawed coordinator's save never ended"
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            cluster.kill(agent)  # the dark node stays gone, as a reclaimed host
        frozen["agent"] = agent.name

    env = trainer_env(tmp_path, steps="200", step_sleep_seconds="0.15", global_batch_size="12",
                      checkpoint_interval_steps="4", heartbeat_timeout_seconds=str(HEARTBEAT_S),
                      fault_injection_file=str(faults),
                      # The commit on the training thread: thawed, that thread asks the fence
                      # before anything else runs (an async save's commit races the training
                      # thread, which finds its peers' sockets closed and ends the process).
                      checkpoint_async="0")
    cluster, codes = run_cluster(tmp_path, env, (2, 3), workers=3, script=freeze_the_coordinator)
    recs = records(cluster)
    resumed = next(r for r in recs if r["event"] in STARTS and r["time"] > frozen["at"])
    print(f"frozen -> resumed at world {resumed['world_size']} after "
          f"{resumed['time'] - frozen['at']:.1f} s (heartbeat {HEARTBEAT_S} s)")
    assert resumed["world_size"] == 2, resumed
    dark = [r for r in recs if r["event"] == "dark_peer" and r["time"] > frozen["at"]]
    assert dark and all(r["rank"] != r["peers"][0] for r in dark), dark
    # The group re-formed without it names its pod planned out (the operator replaces it).
    told = [r for r in recs if r["event"] == "planned_out" and r["time"] > frozen["at"]]
    assert told and told[0]["pods"] == [frozen["agent"]], told
    survivors = sorted({a.name for a in cluster.agents} - {frozen["agent"]})
    assert [codes[a] for a in survivors] == [0, 0], codes
    steps = {r["step"] for r in recs if r["event"] == "step"}
    assert steps == set(range(1, 201)), sorted(steps)
    # Fenced: the thawed coordinator asked the store and refused its commit of step 4 (unfenced
    # it committed, then failed its result's broadcast to the peers that were gone).
    stale = [r for name, r in cluster.records if name == frozen["agent"]
             and r["event"] in SAVE_ENDS and r["time"] > frozen["thawed"]]
    print(f"thawed coordinator: {[(r['event'], r['step']) for r in stale]}")
    assert [(r["event"], r["step"]) for r in stale] == [("checkpoint_fenced", 4)], stale
    assert "re-formed without this worker" in stale[0]["reason"], stale
    catalog = scan(LocalStorage(root))
    assert catalog.newest is not None and catalog.newest.step == 200
    assert (root / "latest").read_text() == catalog.newest.dir
    gens = [c.gen for c in catalog.commits]
    assert gens == sorted(gens) and min(gens) >= 2, catalog.commits
    # Each group's coordinator told the bucket of its generation before committing in it
    # (session.process.record_group_generation), all in the store's one lineage.
    recorded = {r["gen"] for r in recs if r["event"] == "generation_recorded"}
    assert set(gens) <= recorded, (sorted(recorded), gens)
    assert len({c.store_epoch for c in catalog.commits}) == 1, catalog.commits
