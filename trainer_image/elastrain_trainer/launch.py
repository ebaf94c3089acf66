"""torchrun, with one change: a worker-group restart waits for the workers as long as a stop does.

    python -m elastrain_trainer.launch [torchrun options] -m elastrain_trainer

The operator starts workers with this instead of `torchrun` (same options, same PET_* contract).
Why: torchrun stops its workers with SIGTERM and waits `--shutdown-timeout` (PET_SHUTDOWN_TIMEOUT,
which the operator sets from the pod's terminationGracePeriodSeconds) before SIGKILL, but only
when the agent itself is signalled. When a peer is preempted, the *surviving* agents restart their
worker groups for the next rendezvous through `LocalElasticAgent._stop_workers`, which calls
`_shutdown()` with its fixed default of 30 s. Every rank takes part in the SIGTERM checkpoint (a
collective DCP save), so on a real node a save longer than 30 s was SIGKILLed on the survivors and
never committed. Here `_stop_workers` honours the same shutdown timeout.

If a torch release changes these internals, the patch is skipped with a warning and the launcher
behaves exactly like torchrun.
"""

from __future__ import annotations

import sys
from typing import Any


def patch_restart_timeout() -> bool:
    """Make LocalElasticAgent._stop_workers wait `_shutdown_timeout`; False if torch changed."""
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    agent = lea.LocalElasticAgent
    if getattr(agent._stop_workers, "_elastrain", False):
        return True
    if not hasattr(agent, "_shutdown"):
        return False

    def _stop_workers(self: Any, worker_group: Any, *args: Any, **kwargs: Any) -> None:
        timeout = getattr(self, "_shutdown_timeout", None)
        if isinstance(timeout, int) and timeout > 0:
            self._shutdown(timeout=timeout)
        else:
            self._shutdown()

    _stop_workers._elastrain = True  # type: ignore[attr-defined]
    agent._stop_workers = _stop_workers  # type: ignore[method-assign]
    return True


def main(argv: list[str] | None = None) -> None:
    if not patch_restart_timeout():
        print("elastrain launch: torch's elastic agent changed; running plain torchrun",
              file=sys.stderr)
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main()
