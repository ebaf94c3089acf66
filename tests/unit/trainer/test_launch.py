"""elastrain_trainer.launch.agent patches the installed torch's elastic agent as its docstring says:
a worker-group restart waits the configured shutdown timeout, not torchrun's fixed 30 s."""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

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
        assert launch_agent.patch_restart_timeout()
        LocalElasticAgent._stop_workers(agent, None)  # type: ignore[arg-type]
        assert agent.timeouts == [30, 175]
        assert launch_agent.patch_restart_timeout()  # idempotent
    finally:
        LocalElasticAgent._stop_workers = unpatched  # type: ignore[method-assign]
