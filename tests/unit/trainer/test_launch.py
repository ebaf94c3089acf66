"""elastrain_trainer.launch.agent patches the installed torch's elastic agent as its docstring says:
a worker-group restart waits the configured shutdown timeout, not torchrun's fixed 30 s; a torch
without the internals it patches stops the launcher with a message instead of running torchrun."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elastrain_trainer.faults import EXIT_CONFIG
from elastrain_trainer.launch import __main__ as launch_main
from elastrain_trainer.launch import agent as launch_agent


class _Agent:
    """Just the state _stop_workers reads, and a _shutdown that records its timeout."""

    def __init__(self, shutdown_timeout: int) -> None:
        self._shutdown_timeout = shutdown_timeout
        self.timeouts: list[Any] = []

    def _shutdown(self, death_sig: Any = None, timeout: int = 30) -> None:
        self.timeouts.append(timeout)


def test_restarting_workers_waits_the_shutdown_timeout() -> None:
    unpatched = LocalElasticAgent._stop_workers
    try:
        agent = _Agent(shutdown_timeout=175)
        # torch as shipped: a restart SIGKILLs after 30 s whatever --shutdown-timeout says.
        getattr(unpatched, "__wrapped__", unpatched)(agent, None)
        assert agent.timeouts == [30]
        launch_agent.patch_restart_timeout()
        LocalElasticAgent._stop_workers(agent, None)  # type: ignore[arg-type]
        assert agent.timeouts == [30, 175]
        launch_agent.patch_restart_timeout()  # idempotent
        LocalElasticAgent._stop_workers(agent, None)  # type: ignore[arg-type]
        assert agent.timeouts == [30, 175, 175]
    finally:
        LocalElasticAgent._stop_workers = unpatched  # type: ignore[method-assign]


def test_a_torch_without_the_agent_hooks_stops_the_launcher_saying_why(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A torch whose _shutdown no longer takes a timeout: the launcher must not run plain torchrun.
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda self: None)
    monkeypatch.delenv("ELASTRAIN_PLAIN_TORCHRUN", raising=False)
    monkeypatch.setattr("torch.distributed.run.main", lambda argv: pytest.fail("torchrun ran"))
    assert launch_main.main(["--nproc-per-node", "1", "train.py"]) == EXIT_CONFIG
    said = capsys.readouterr().err
    assert "elastrain: configuration error: launcher:" in said
    assert "LocalElasticAgent._shutdown(timeout=)" in said
    assert "torch>=2.15,<2.16" in said and "ELASTRAIN_PLAIN_TORCHRUN=1" in said


# --- a crash after the world finished (launch/agent.py, peers_finished): torch's own exit
# barrier keys on a real in-memory store, the peers played by adding to it as torch's agent does


def _peer_arrives(store: Any, world_size: int) -> None:
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.utils import store as store_util

    store_util._barrier_nonblocking(store, world_size, agent_api._TERMINAL_STATE_SYNC_ID)


def _store() -> Any:
    from torch.distributed import HashStore

    store = HashStore()
    store.set_timeout(__import__("datetime").timedelta(seconds=2))
    return store


def test_a_node_is_finished_when_every_peer_waits_at_the_exit_barrier() -> None:
    store = _store()
    _peer_arrives(store, 3)
    _peer_arrives(store, 3)
    assert launch_agent.peers_finished(store, 3, lambda: 0, timeout=5.0)


def test_a_missing_peer_is_not_finished_and_a_restarting_peer_ends_the_wait_at_once() -> None:
    store = _store()
    _peer_arrives(store, 3)  # one of two peers finished; the other never arrives
    assert not launch_agent.peers_finished(store, 3, lambda: 0, timeout=0.3)
    # A peer waiting for a new round (it restarted after this node's crash mid-training): the
    # answer comes before the timeout would.
    polls: list[int] = []

    def waiting() -> int:
        polls.append(1)
        return 1

    store = _store()
    assert not launch_agent.peers_finished(store, 2, waiting, timeout=3600.0)
    assert len(polls) == 1


def test_a_world_whose_every_node_crashed_did_not_finish() -> None:
    """Every node's worker crashed (one that cannot start, on every node): each arrives at the
    barrier from its own crash, and none may take it for a finished world (seen: an import
    error on all 3 nodes ended every pod 0 as "training is complete")."""
    store = _store()
    answers: list[bool] = []
    threads = [threading.Thread(target=lambda: answers.append(
        launch_agent.peers_finished(store, 3, lambda: 0, timeout=10.0))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [False, False, False]
    # One crashed after its peers finished (they arrive from torch's own barrier): finished.
    store = _store()
    _peer_arrives(store, 3)
    _peer_arrives(store, 3)
    assert launch_agent.peers_finished(store, 3, lambda: 0, timeout=5.0)
