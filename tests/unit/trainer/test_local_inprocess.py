"""A local run in process: the summary of its regroups (pure, from records) and the supervisor's
reading of a preempted node that left cleanly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastrain_trainer.launch.supervise import RestartBudget, Supervisor
from elastrain_trainer.summary import summarize
from tests.unit.trainer.test_supervise import Agents


def step(n: int, at: float, world: int) -> dict[str, Any]:
    return {"event": "step", "step": n, "loss": 5.0 - n / 10, "world_size": world, "time": at}


def regroup(gen: int, reason: str, n: int, world: int, at: float, node: str = "agent-0",
            healed_from: str | None = None) -> dict[str, Any]:
    return {"event": "regroup", "gen": gen, "reason": reason, "step": n, "world_size": world,
            "time": at, "node": node, "healed_from": healed_from}


# Steps 1 s apart; the leave after step 3 and the join after step 6 make the steps across them
# 0.9 s and 0.2 s longer; the joiner announces the join too, healed from the survivor.
RECORDS = [regroup(1, "start", 0, 2, 0.5),
           *(step(n, n, 2) for n in (1, 2, 3)), regroup(2, "leave", 3, 1, 3.5),
           *(step(n, n + 0.9, 1) for n in (4, 5, 6)), regroup(3, "join", 6, 2, 7.2),
           regroup(3, "join", 6, 2, 7.25, node="agent-2", healed_from="agent-0"),
           *(step(n, n + 1.1, 2) for n in (7, 8)), {"event": "finished", "time": 9.5}]


def test_a_leave_and_a_join_are_two_regroups_that_lose_nothing() -> None:
    s = summarize(RECORDS)
    assert (s.finished, s.final_step, s.resumes, s.world_sizes) == (True, 8, 0, [2, 1, 2])
    assert (s.regroups, s.regroup_reasons, s.lost_per_regroup) == (2, ["leave", "join"], [0, 0])
    assert s.steps_lost == 0
    assert s.regroup_pauses_s == [0.9, 0.2]
    assert s.heals == ["agent-2 from agent-0"]


def test_a_regroup_behind_the_steps_trained_loses_them() -> None:
    # Step 4 was trained, then a failure: the next generation starts again at step 3.
    recs = [*(step(n, n, 2) for n in (1, 2, 3, 4)), regroup(2, "fail", 3, 1, 4.5),
            step(4, 5.5, 1)]
    s = summarize(recs)
    assert (s.regroup_reasons, s.lost_per_regroup, s.steps_lost) == (["fail"], [1], 1)


def test_a_preempted_agent_that_exits_0_does_not_end_the_restarts(tmp_path: Path) -> None:
    """In process, a SIGTERMed node leaves at a step boundary and its launcher exits 0: that is
    the caller's preemption, not the end of training, so a later crash is still replaced."""
    cluster = Agents(tmp_path)
    cluster.preempted.append(cluster.add_agent())
    cluster.add_agent("import sys; print('elastrain crash: boom'); sys.exit(1)")
    for agent in cluster.agents:
        agent.proc.wait()
    outcome = Supervisor(cluster, RestartBudget(max_restarts=1)).run(  # type: ignore[arg-type]
        timeout=60, poll=0.01)
    assert outcome.restarts == 1 and not outcome.failed, outcome
    assert outcome.exit_codes == {"agent-0": 0, "agent-1": 1, "agent-2": 0}
