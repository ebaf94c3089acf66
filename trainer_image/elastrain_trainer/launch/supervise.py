"""Local mode's stand-in for the operator: count each agent's end, replace it, or give up.

On Kubernetes the operator reads each worker pod's end; here `Supervisor` reads each agent
process's (exit code and the last lines of its log) and applies the same rules:

- a crash of the job's own making (the launcher's "elastrain: worker crashed: ..." line, or any
  other non-zero exit of an agent nobody stopped) counts against max_restarts, and its
  replacement starts after the backoff (backoff_seconds doubling per crash); the
  (max_restarts+1)th crash fails the run with that crash's reason;
- a configuration error (the launcher's "elastrain: configuration error: ..." line: an unreadable
  dataset, an invalid setting, a command that does not exist) fails the run at once with the
  trainer's message (`failed_reason` ConfigurationError): no restart could fix it;
- an agent that lost the rendezvous store (the store process died: every agent exits with
  RendezvousConnectionError) is not the job's fault: the store is started again on the same
  port and the agent is replaced at once, uncounted;
- an agent the caller preempted (LocalCluster.preempt) is the caller's to replace, whatever
  its exit code;
- any other agent that exits 0 finished training: nothing is replaced after that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from elastrain_trainer.faults import CONFIG_PREFIX, CRASH_PREFIX
from elastrain_trainer.launch.cluster import Agent, LocalCluster

STORE_LOST = "RendezvousConnectionError"
MAX_RESTARTS_EXCEEDED = "MaxRestartsExceeded"
CONFIGURATION_ERROR = "ConfigurationError"


@dataclass(frozen=True)
class RestartBudget:
    """spec.restartPolicy, as far as local mode applies it."""

    max_restarts: int = 3
    backoff_seconds: float = 0.0
    max_backoff_seconds: float = 300.0

    def backoff(self, restarts: int) -> float:
        if restarts < 1 or not self.backoff_seconds:
            return 0.0
        return float(min(self.backoff_seconds * 2 ** min(restarts - 1, 32),
                          self.max_backoff_seconds))


@dataclass
class Outcome:
    """What supervision counted; `failed` is why the run failed, if it did, and
    `failed_reason` the operator's condition reason for it."""

    restarts: int = 0
    store_losses: int = 0
    crashes: list[str] = field(default_factory=list)
    failed: str | None = None
    failed_reason: str = ""
    exit_codes: dict[str, int | None] = field(default_factory=dict)


def last_lines(path: Path, limit: int = 64 * 1024) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def crash_line(log_tail: str) -> str | None:
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip().startswith(CRASH_PREFIX)]
    return lines[-1] if lines else None


def config_error(log_tail: str) -> str | None:
    """The trainer's message of the last configuration-error line in an agent's log."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip().startswith(CONFIG_PREFIX)]
    return lines[-1].removeprefix(CONFIG_PREFIX) if lines else None


class Supervisor:
    def __init__(self, cluster: LocalCluster, budget: RestartBudget) -> None:
        self.cluster, self.budget = cluster, budget
        self.outcome = Outcome()
        self._seen: set[int] = set()
        self._due: list[float] = []  # monotonic times at which to start a replacement
        self._finished = False

    def run(self, timeout: float, poll: float = 0.2) -> Outcome:
        """Until every agent ended and nothing is due, the run failed, or the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for agent in list(self.cluster.agents):
                if agent.proc.poll() is not None and id(agent) not in self._seen:
                    self._seen.add(id(agent))
                    self._ended(agent)
                    if self.outcome.failed:
                        self.cluster.stop()
                        return self._done()
            now = time.monotonic()
            if self._due and not self._finished and self._due[0] <= now:
                self._due.pop(0)
                self.cluster.add_agent()
                continue
            if self._finished:
                self._due.clear()
            # Every agent ended *and* handled: one that exited after the loop above looked at it
            # is handled next round (seen: a crash never restarted, the run ended as if done).
            if not self._due and all(id(a) in self._seen for a in self.cluster.agents):
                return self._done()
            time.sleep(poll)
        return self._done()

    def _done(self) -> Outcome:
        self.outcome.exit_codes = {a.name: a.proc.poll() for a in self.cluster.agents}
        return self.outcome

    def _ended(self, agent: Agent) -> None:
        code = agent.proc.returncode
        # Before the exit code: a preempted node that leaves in process exits 0 without having
        # finished the training.
        if agent in self.cluster.preempted:
            return
        if code == 0:
            self._finished = True
            return
        tail = last_lines(agent.log_path)
        if STORE_LOST in tail or not self.cluster.store_alive():
            self.outcome.store_losses += 1
            self.cluster.ensure_store()
            self._due.append(time.monotonic())
            print(f"[local] {agent.name} lost the rendezvous store; store restarted, agent "
                  "replaced (not counted as a failure)", flush=True)
            return
        if (config := config_error(tail)) is not None:
            self.outcome.failed, self.outcome.failed_reason = config, CONFIGURATION_ERROR
            print(f"[local] {agent.name}: configuration error, not restarted: {config}",
                  flush=True)
            return
        reason = crash_line(tail) or f"agent {agent.name} exited with code {code}"
        self.outcome.restarts += 1
        self.outcome.crashes.append(reason)
        if self.outcome.restarts > self.budget.max_restarts:
            self.outcome.failed = (f"{self.outcome.restarts} worker failures exceed "
                                   f"restartPolicy.maxRestarts ({self.budget.max_restarts}); "
                                   f"last: {reason}")
            self.outcome.failed_reason = MAX_RESTARTS_EXCEEDED
            print(f"[local] {self.outcome.failed}", flush=True)
            return
        delay = self.budget.backoff(self.outcome.restarts)
        self._due.append(time.monotonic() + delay)
        self._due.sort()
        print(f"[local] {agent.name} failed ({reason}); restart {self.outcome.restarts}/"
              f"{self.budget.max_restarts}, replacement in {delay:.0f} s", flush=True)
