"""Restart mode, a node that goes dark (issue 34; session.dark_peers): real torchrun agents
against a real rendezvous store, one agent frozen whole (SIGSTOP of the agent and its worker: no
beat, no socket closed, as a hung or partitioned host).

The survivors' all-reduce would wait out gloo's collective timeout (5 minutes); instead each
survivor's watch finds the frozen rank's heartbeat silent and ends its process as a lost peer
does, torchrun's rendezvous re-forms the group without the frozen node (once its keep-alive
lapses) and it resumes from the newest checkpoint at world 2. Seen failing with the watch off
(`start_dark_peer_watch` returning None): no resume within the wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from elastrain_trainer.launch.cluster import LocalCluster, descendants
from tests.warmstart import started_pid

from .conftest import trainer_env
from .test_elastic import records, run_cluster

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(300)]
HEARTBEAT_S = 2.0


def node_processes(pid: int) -> list[int]:
    """The agent started as `pid` and every process under it, warm starts included (a shim's
    process runs in the fork server's tree: started_pid names it)."""
    out, todo = [], [pid]
    while todo:
        real = started_pid(todo.pop())
        out.append(real)
        todo += [p for p in descendants(real) if p not in out]
    return sorted(set(out))


def test_a_frozen_node_restarts_the_group_by_the_heartbeat_not_the_collective_timeout(
        tmp_path: Path) -> None:
    frozen: dict[str, float] = {}

    def freeze_one(cluster: LocalCluster) -> None:
        assert cluster.wait_for_step(10, timeout=180)
        agent = cluster.agents[2]
        pids = node_processes(agent.proc.pid)
        frozen["at"] = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            # Far below the collective timeout (300 s): only the heartbeat's path is this fast.
            assert cluster.wait_for(lambda rs: any(
                r["event"] == "resumed" and r["time"] > frozen["at"] for _, r in rs),
                timeout=90), "the survivors never resumed without the frozen node"
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            cluster.kill(agent)  # the dark node stays gone, as a reclaimed host

    env = trainer_env(tmp_path, steps="200", step_sleep_seconds="0.15", global_batch_size="12",
                      checkpoint_interval_steps="4", heartbeat_timeout_seconds=str(HEARTBEAT_S))
    cluster, codes = run_cluster(tmp_path, env, (2, 3), workers=3, script=freeze_one)
    recs = records(cluster)
    resumed = next(r for r in recs if r["event"] == "resumed" and r["time"] > frozen["at"])
    print(f"frozen -> resumed at world {resumed['world_size']} after "
          f"{resumed['time'] - frozen['at']:.1f} s (heartbeat {HEARTBEAT_S} s)")
    assert resumed["world_size"] == 2, resumed
    dark = [r for r in recs if r["event"] == "dark_peer" and r["time"] > frozen["at"]]
    assert dark and all(r["rank"] != r["peers"][0] for r in dark), dark
    assert (codes["agent-0"], codes["agent-1"]) == (0, 0), codes
    steps = {r["step"] for r in recs if r["event"] == "step"}
    assert steps == set(range(1, 201)), sorted(steps)
