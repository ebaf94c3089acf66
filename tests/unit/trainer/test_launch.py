"""elastrain_trainer.launch.agent patches the installed torch's elastic agent as its docstring says:
a worker-group restart waits the configured shutdown timeout, not torchrun's fixed 30 s; a torch
without the internals it patches stops the launcher with a message instead of running torchrun."""

from __future__ import annotations

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
