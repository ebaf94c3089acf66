"""The local supervisor's bookkeeping: an agent's end is always handled before the run ends."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain_trainer.launch.cluster import Agent
from elastrain_trainer.launch.supervise import RestartBudget, Supervisor


class SeenRunningOnce(subprocess.Popen[bytes]):
    """A real process whose first poll() answers "running" even after it ended: the
    interleaving where an agent exits between the supervisor's look at each agent and its
    check that all have ended (seen in CI under load), forced instead of waited for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._polls = 0

    def poll(self) -> int | None:
        self._polls += 1
        self.wait()
        return None if self._polls == 1 else self.returncode


@dataclass
class Agents:
    """What the Supervisor uses of a LocalCluster: agents that are plain processes (a
    crashing one first, a replacement that exits 0), no store, no torchrun."""

    root: Path
    agents: list[Agent] = field(default_factory=list)
    preempted: list[Agent] = field(default_factory=list)

    def add_agent(self, script: str = "raise SystemExit(0)",
                  proc: type[subprocess.Popen[bytes]] = subprocess.Popen) -> Agent:
        log = self.root / f"agent-{len(self.agents)}.log"
        agent = Agent(f"agent-{len(self.agents)}",
                      proc([sys.executable, "-c", script], stdout=log.open("wb"),
                           stderr=subprocess.STDOUT), log)
        self.agents.append(agent)
        return agent

    def store_alive(self) -> bool:
        return True

    def stop(self) -> None:
        for a in self.agents:
            if a.proc.poll() is None:
                a.proc.kill()


def test_an_agent_that_ends_while_the_others_are_checked_is_still_restarted(
        tmp_path: Path) -> None:
    cluster = Agents(tmp_path)
    cluster.add_agent("import sys; print('elastrain crash: boom'); sys.exit(1)",
                      proc=SeenRunningOnce)
    outcome = Supervisor(cluster, RestartBudget(max_restarts=1)).run(  # type: ignore[arg-type]
        timeout=60, poll=0.01)
    assert outcome.restarts == 1 and not outcome.failed, outcome
    assert [a.name for a in cluster.agents] == ["agent-0", "agent-1"]
    assert outcome.exit_codes == {"agent-0": 1, "agent-1": 0}
