"""A rendezvous store and N torchrun agents ("nodes") as processes on this machine.

`LocalCluster` is the machinery under `elastrain run --local` (local.py, supervise.py) and
under tests that inject preemptions themselves. Each agent runs elastrain's launcher
(`python -m elastrain_trainer.launch`, as worker pods do) with one worker (nproc 1), in the
recovery mode its env says (ELASTRAIN_RECOVERY, as the operator renders it):

- restart (no ELASTRAIN_RECOVERY): the elastic settings of notes/rendezvous.md: the store as
  c10d's external store, is_host=false, 1 s x 3 keep-alives, and
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1;
- inProcess: what such a worker pod runs, torchrun standalone (the env's PET_*), the trainers'
  membership on the store (ELASTRAIN_STORE); each agent is a new member, its name the node id
  (a pod's name).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain_trainer.events import parse_line
from elastrain_trainer.launch import rdzv_store
from elastrain_trainer.ports import free_port

RDZV_CONF = ("is_host=false,last_call_timeout=1,join_timeout=600,keep_alive_interval=1,"
             "keep_alive_max_attempt=3")
Record = dict[str, Any]
# What a worker runs after the launcher's options: the built-in trainer (the pods' default).
TRAINER_ENTRY = ("-m", "elastrain_trainer")


@dataclass
class Agent:
    """One torchrun agent process and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class LocalCluster:
    """Store + agents; records every JSON line the workers print, tagged with the agent."""

    env: Mapping[str, str]
    min_nodes: int
    max_nodes: int
    out_dir: Path
    job_id: str = "local"
    entry: tuple[str, ...] = TRAINER_ENTRY
    cwd: Path | None = None
    on_record: Callable[[str, Record], None] | None = None
    records: list[tuple[str, Record]] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)
    preempted: list[Agent] = field(default_factory=list)
    _store: subprocess.Popen[bytes] | None = None
    _port: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def start(self, workers: int) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._port = free_port()
        self.ensure_store()
        for _ in range(workers):
            self.add_agent()

    @property
    def store(self) -> subprocess.Popen[bytes] | None:
        return self._store

    def store_alive(self) -> bool:
        return self._store is not None and self._store.poll() is None

    def ensure_store(self) -> None:
        """Start the rendezvous store (again, on the same port) unless it runs."""
        if self.store_alive():
            return
        self._store = subprocess.Popen(
            rdzv_store.command("127.0.0.1", self._port),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait_for_port(self._port, timeout=60)

    @property
    def in_process(self) -> bool:
        return self.env.get("ELASTRAIN_RECOVERY") == "inProcess"

    def add_agent(self) -> Agent:
        name = f"agent-{len(self.agents)}"
        env = {**os.environ, **self.env, "OMP_NUM_THREADS": self.env.get("OMP_NUM_THREADS", "1"),
               "PYTHONUNBUFFERED": "1"}
        port = int(self.env.get("ELASTRAIN_METRICS_PORT", "0"))
        env["ELASTRAIN_METRICS_PORT"] = str(port + len(self.agents) if port else 0)
        # The launcher the operator gives worker pods: torchrun, restarts waiting like stops.
        cmd = [sys.executable, "-m", "elastrain_trainer.launch"]
        if self.in_process:
            # This machine's store stands in for the job's store pod.
            env.update(ELASTRAIN_STORE=f"127.0.0.1:{self._port}", ELASTRAIN_NODE_ID=name)
        else:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            # As in a pod (render.env): the workers' dark-peer watch beats on this store.
            env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{self._port}"
            env["ELASTRAIN_POD_NAME"] = name  # which the dark-peer watch marks
            cmd += [f"--nnodes={self.min_nodes}:{self.max_nodes}", "--nproc-per-node=1",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self._port}",
                    f"--rdzv-id={self.job_id}", f"--rdzv-conf={RDZV_CONF}",
                    "--max-restarts=100", "--monitor-interval=0.5"]
        cmd += self.entry
        log_path = self.out_dir / f"{name}.log"
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, cwd=self.cwd,
                                stderr=subprocess.STDOUT, start_new_session=True)
        agent = Agent(name, proc, log_path)
        self.agents.append(agent)
        threading.Thread(target=self._pump, args=(agent,), daemon=True).start()
        return agent

    def _pump(self, agent: Agent) -> None:
        assert agent.proc.stdout is not None
        with agent.log_path.open("wb") as log:
            for raw in agent.proc.stdout:
                log.write(raw)
                log.flush()
                record = parse_line(raw.decode(errors="replace"))
                if record is None:
                    continue
                with self._cond:
                    self.records.append((agent.name, record))
                    self._cond.notify_all()
                if self.on_record is not None:
                    self.on_record(agent.name, record)

    def max_step(self) -> int:
        with self._cond:
            return max((r["step"] for _, r in self.records if r["event"] == "step"), default=0)

    def wait_for(self, predicate: Callable[[list[tuple[str, Record]]], bool],
                 timeout: float) -> bool:
        """Block until predicate(records) holds; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.records), timeout=timeout)

    def wait_for_step(self, step: int, timeout: float = 300) -> bool:
        return self.wait_for(lambda rs: any(r["event"] == "step" and r["step"] >= step
                                            for _, r in rs), timeout)

    def preempt(self, agent: Agent) -> None:
        """Spot-style notice: SIGTERM the agent, which SIGTERMs its worker."""
        self.preempted.append(agent)
        agent.proc.send_signal(signal.SIGTERM)

    def kill(self, agent: Agent) -> None:
        """No notice: SIGKILL the worker(s) and the agent together (a lost node)."""
        if agent.proc.poll() is None:
            self.preempted.append(agent)
        for pid in [*descendants(agent.proc.pid), agent.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def wait_agents(self, timeout: float) -> dict[str, int | None]:
        """Exit codes of all agents (None for those still running at the deadline)."""
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return {a.name: a.proc.poll() for a in self.agents}

    def stop(self) -> None:
        """Kill whatever is still running (agents, their workers, the store)."""
        for agent in self.agents:
            if agent.proc.poll() is None:
                self.kill(agent)
            agent.proc.wait(timeout=30)
        if self._store is not None and self._store.poll() is None:
            self._store.send_signal(signal.SIGTERM)
            self._store.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    """All live descendant pids of `pid` (torchrun workers run in their own session)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"rendezvous store did not listen on port {port} in {timeout} s")
