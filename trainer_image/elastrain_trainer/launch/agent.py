"""The patches to torchrun's elastic agent that `python -m elastrain_trainer.launch` applies.

First change: a worker-group restart waits for the workers as long as a stop does.
The operator starts workers with the launcher instead of `torchrun` (same options, same PET_*
contract; see __main__.py). Why: torchrun stops its workers with SIGTERM and waits
`--shutdown-timeout` (PET_SHUTDOWN_TIMEOUT, which the operator sets from the pod's
terminationGracePeriodSeconds) before SIGKILL, but only when the agent itself is signalled. When
a peer is preempted, the *surviving* agents restart their worker groups for the next rendezvous
through `LocalElasticAgent._stop_workers`, which calls `_shutdown()` with its fixed default of
30 s. Every rank takes part in the SIGTERM checkpoint (a collective DCP save), so on a real node
a save longer than 30 s was SIGKILLed on the survivors and never committed. Here `_stop_workers`
honours the same shutdown timeout.

Second change: a worker's own crash stops this node instead of restarting it in place.
torchrun restarts a failed worker group in place up to --max-restarts, whatever the cause. The
operator sets that very high, because a peer lost to preemption also fails the survivors'
collectives and they must restart to re-rendezvous; but then a trainer that raises at step N
crashes there forever while the pod stays Running and restartPolicy.maxRestarts never applies.
So the agent here classifies each failed worker (elastrain_trainer.faults): a lost peer or a stop
restarts in place as before, uncounted; a crash ends the agent with exit code 1 and a one-line
reason in the pod's termination message (ELASTRAIN_TERMINATION_LOG, default
/dev/termination-log) that the operator counts against maxRestarts, with its backoff, and quotes
in its events and its MaxRestartsExceeded condition. A worker that exited EXIT_CONFIG (a
configuration error, elastrain_trainer.faults) ends the agent with exit code EXIT_CONFIG and the
line `elastrain: configuration error: <the trainer's message>`, which fails the job at once.
The crashed agent leaves the rendezvous open: torchrun would close it for the whole rendezvous
id on the way out, and the replacement worker (same id) could never join; the survivors carry
on above minReplicas or wait for it.

Except after the world finished: a worker that dies after its last collective (a C++ thread
aborting the interpreter's teardown, an exit hook) while every other node's workers exited 0
would be counted and replaced, and the replacement could never join (the world is done), while
its peers sat in torchrun's exit barrier for 5 minutes waiting for this node. So before it
counts a crash, a node of a multi-node world arrives at that exit barrier itself and waits up to
FINISHED_WAIT_SECONDS for the others (a node arrives there once its workers succeeded, or
crashed): when all arrive and not every one of them crashed, the world's training is complete,
the crash is reported as a warning and the node ends 0 like its peers; as soon as a node
waits for a new round instead (a peer restarting after this crash mid-training) or the wait
runs out, the crash counts as before.

Third change: a stop's signal reaches each worker's own process, its process group only at the
deadline. torchrun starts each worker in a session of its own and stops it with
`os.killpg(SIGTERM)`, so a notice (a pod's eviction, `elastrain run --local`'s preemption, a
worker-group restart, a local rank's failure: all go through the same worker context's close)
also struck the processes the trainer started: a DataLoader's workers died of it and the
trainer raised "DataLoader worker ... is killed by signal: Terminated" mid-step or mid-save, so
no SIGTERM checkpoint was written (restart mode) or the node failed instead of leaving
(in-process mode). Here the signal goes to the worker's process alone; its children serve it
until it stops at a step boundary and are shut down by it. The group is SIGKILLed at
--shutdown-timeout as before (a worker that ignores the notice with it), and once a notified
worker has exited whatever it left in its group is SIGKILLed too.

All patches use torch internals (listed in elastrain_trainer.private_hooks). If a torch release
changes them, patching raises MissingPrivateHook naming the hook and the tested torch versions,
and the launcher stops (a configuration error: no restart installs another torch) rather than
run as plain torchrun without the crash budget, the long restart saves and the notice to the
trainer alone;
ELASTRAIN_PLAIN_TORCHRUN=1 asks for plain torchrun explicitly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastrain_trainer.faults import (
    CRASH_PREFIX,
    EXIT_CONFIG,
    WARNING_PREFIX,
    config_reason,
    crash_reason,
    is_crash,
    reason_of,
)
from elastrain_trainer.private_hooks import MissingPrivateHook, missing, require, require_params
from elastrain_trainer.signals import EXIT_STORE_LOST

TERMINATION_LOG = Path(os.environ.get("ELASTRAIN_TERMINATION_LOG", "/dev/termination-log"))
# What torch puts in a failure's message when the worker left no error file.
_NO_ERROR_FILE = "To enable traceback see"


class WorkerCrashed(Exception):
    """A worker of this node crashed on its own; the message is the one-line reason."""


class StoreLost(Exception):
    """In-process recovery: a worker exited EXIT_STORE_LOST (the job's store is gone and a
    membership change needs it); the message says so with RendezvousConnectionError, the word
    the operator classifies as the platform's loss (a preemption: the pod is replaced)."""


class WorkerMisconfigured(WorkerCrashed):
    """A worker exited EXIT_CONFIG: the message is the CONFIG_PREFIX line that fails the job."""


# How long a node whose worker crashed waits at the exit barrier for its peers. A peer arrives
# once its agent saw its workers exit 0 (PET_MONITOR_INTERVAL 0.5 s) after their interpreter's
# teardown, seconds on a loaded node; a crash mid-training stops the wait early (peers_finished).
FINISHED_WAIT_SECONDS = 10.0
# Beside torch's exit-barrier keys: how many of this round's nodes arrived there crashed.
CRASHED_KEY = "/elastrain_crashed"
_FINISHED_WORLD = "to tell a crash after the world finished training from one that needs a restart"
_RESTART_WAITS = "so that a worker-group restart waits --shutdown-timeout for the SIGTERM save"
_CRASH_BUDGET = "to stop the node on a worker's own crash (the crash budget)"
_NOTICE = ("so that a stop's SIGTERM reaches each worker's own process, not the processes it "
           "started (a DataLoader's workers)")


def patch_restart_timeout() -> None:
    """Make LocalElasticAgent._stop_workers wait `_shutdown_timeout` (MissingPrivateHook if
    torch changed what this relies on)."""
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    agent = lea.LocalElasticAgent
    require(agent, "_stop_workers", library="torch", needed_for=_RESTART_WAITS)
    shutdown = require(agent, "_shutdown", library="torch", needed_for=_RESTART_WAITS)
    require_params(shutdown, ["timeout"], hook="LocalElasticAgent._shutdown", library="torch",
                   needed_for=_RESTART_WAITS)
    # The agent keeps --shutdown-timeout as _shutdown_timeout (checked on each new agent).
    require_params(agent.__init__, ["shutdown_timeout"], hook="LocalElasticAgent",
                   library="torch", needed_for=_RESTART_WAITS)
    if getattr(agent._stop_workers, "_elastrain", False):
        return

    def _stop_workers(self: Any, worker_group: Any, *args: Any, **kwargs: Any) -> None:
        timeout = getattr(self, "_shutdown_timeout", None)
        if isinstance(timeout, int) and timeout > 0:
            self._shutdown(timeout=timeout)
        else:
            self._shutdown()

    _stop_workers._elastrain = True  # type: ignore[attr-defined]
    agent._stop_workers = _stop_workers  # type: ignore[method-assign]


def patch_notice_to_trainer() -> None:
    """Make torch's worker context signal each worker's process, and kill its process group
    only at the deadline or once the worker exited (see the module docstring;
    MissingPrivateHook if torch changed what this relies on)."""
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = require(subprocess_handler, "SubprocessHandler", library="torch",
                      needed_for=_NOTICE)
    require_params(require(handler, "close", library="torch", needed_for=_NOTICE),
                   ["death_sig"], hook="SubprocessHandler.close", library="torch",
                   needed_for=_NOTICE)
    context = require(mp_api, "SubprocessContext", library="torch", needed_for=_NOTICE)
    require_params(require(context, "_close", library="torch", needed_for=_NOTICE),
                   ["death_sig", "timeout"], hook="SubprocessContext._close", library="torch",
                   needed_for=_NOTICE)
    if getattr(context._close, "_elastrain", False):
        return
    torch_close, torch_close_all = handler.close, context._close
    # The replacements below take over what torch's do with these (the worker's Popen, its log
    # files, the context's handlers); a torch that keeps them elsewhere is not patched blind.
    for hook, fn, names in (
            ("SubprocessHandler.close", torch_close, {"killpg", "proc", "_stdout", "_stderr"}),
            ("SubprocessContext._close", torch_close_all, {"subprocess_handlers", "proc"})):
        if not names <= set(fn.__code__.co_names):
            raise missing(f"{hook}'s use of {', '.join(sorted(names))}", "torch", _NOTICE)

    def close(self: Any, death_sig: signal.Signals | None = None) -> None:
        if death_sig == signal.SIGKILL:  # the deadline: the whole group, as torch does
            torch_close(self, death_sig)
            return
        # The notice is the trainer's alone (its DataLoader's workers keep serving it).
        self.proc.send_signal(death_sig or signal.SIGTERM)
        for log in (self._stdout, self._stderr):
            if log:
                log.close()

    def _close(self: Any, death_sig: signal.Signals, timeout: int = 30) -> None:
        workers = [h.proc for h in self.subprocess_handlers.values()]
        torch_close_all(self, death_sig, timeout)
        for proc in workers:
            # What a worker left in its group: run() ends the trainer with os._exit, which
            # skips the DataLoader's shutdown of its workers while anything still holds the
            # loader's iterator; and a worker that died on its own (SIGKILL, OOM) leaves its
            # loader workers holding its gloo sockets open, so its peers would not see it gone
            # until their watchdog (5 s) ends them. (A group's id is not reused while it has
            # members; an empty group is ProcessLookupError.)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    _close._elastrain = True  # type: ignore[attr-defined]
    handler.close = close
    context._close = _close


def failure_message(failure: Any) -> str:
    """The error-file message of a torchelastic ProcessFailure ("" when it left none)."""
    message = getattr(failure, "message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message or "")
    return "" if message.startswith(_NO_ERROR_FILE) else message


def config_error_of(failures: dict[int, Any]) -> str | None:
    """The configuration-error line of the first rank that exited EXIT_CONFIG; None if none."""
    for _rank, failure in sorted(failures.items()):
        if int(failure.exitcode) == EXIT_CONFIG:
            return config_reason(failure_message(failure) or "the trainer exited with code "
                                 f"{EXIT_CONFIG} (a configuration error); see its log")
    return None


def crash_of(failures: dict[int, Any]) -> str | None:
    """The reason of the first failed rank whose end is a crash of its own; None if none is."""
    for rank, failure in sorted(failures.items()):
        message = failure_message(failure)
        if is_crash(int(failure.exitcode), message):
            return crash_reason(int(failure.exitcode), message, rank)
    return None


# The workers' exit codes after the agent's last shutdown (None: unknown). In-process recovery
# reads them when the agent was signalled: a worker that left the job cleanly makes the pod end 0.
shutdown_exit_codes: dict[int, int | None] | None = None


def exit_codes_of(pcontext: Any) -> dict[int, int | None] | None:
    """Each local rank's exit code (None: still running) of a subprocess context; None when the
    context does not say (a torch without `subprocess_handlers`: then nothing is claimed)."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if not isinstance(handlers, dict) or not handlers:
        return None
    return {int(rank): getattr(getattr(h, "proc", None), "returncode", None)
            for rank, h in handlers.items()}


def left_cleanly() -> bool:
    """Every worker exited 0 in the agent's last shutdown (a signalled in-process node that left
    the job at a step boundary)."""
    codes = shutdown_exit_codes
    return codes is not None and all(code == 0 for code in codes.values())


def store_lost_of(failures: dict[int, Any]) -> str | None:
    """In-process mode: the line that ends the pod when a worker exited EXIT_STORE_LOST."""
    if os.environ.get("ELASTRAIN_RECOVERY") != "inProcess":
        return None
    for rank, failure in sorted(failures.items()):
        if int(failure.exitcode) == EXIT_STORE_LOST:
            what = failure_message(failure)
            return (f"elastrain: the job's store is lost (RendezvousConnectionError): rank "
                    f"{rank} needed it for a membership change"
                    + (f" ({reason_of(what)})" if what else ""))
    return None


def peers_finished(store: Any, world_size: int, nodes_waiting: Callable[[], int], *,
                   timeout: float, poll: float = 0.1) -> bool:
    """A crashed node's: arrive at torchrun's exit barrier of this round and wait up to
    `timeout` for the other nodes. True when all `world_size` arrived and not all of them
    crashed (a node whose workers succeeded arrives from torch's own exit barrier); False when
    every node crashed, the time runs out, or a node waits for a new round (a peer that
    restarts after this node's crash mid-training will never arrive). MissingPrivateHook if
    torch changed the barrier's keys."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.utils import store as store_util

    prefix = require(agent_api, "_TERMINAL_STATE_SYNC_ID", library="torch",
                     needed_for=_FINISHED_WORLD)
    arrive = require(store_util, "_barrier_nonblocking", library="torch",
                     needed_for=_FINISHED_WORLD)
    # A crashed node arrives too (here), so count them: when every node crashed (a worker
    # that cannot start, on every node), nobody finished anything (seen: a ModuleNotFoundError
    # on all 3 nodes was reported as a world that finished, and every pod ended 0).
    crashed = f"{prefix}{CRASHED_KEY}"
    store.add(crashed, 1)
    last = arrive(store=store, world_size=world_size, key_prefix=prefix)
    deadline = time.monotonic() + timeout
    while not store.check([last]):
        if nodes_waiting() > 0 or time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return int(store.add(crashed, 0)) < world_size


def finished_world_warning(crash: str, nodes: int) -> str:
    """The line a node ends 0 with when its worker crashed after every node finished."""
    what = crash.removeprefix(CRASH_PREFIX)
    return (f"{WARNING_PREFIX}worker crashed: {what}, after all {nodes} nodes "
            "finished training (every other node's workers exited 0); training is complete, so "
            "this node ends 0 and is not restarted")


def patch_crash_budget() -> None:
    """Make torchrun's agent stop the node on a crash (see the module docstring;
    MissingPrivateHook if torch changed what this relies on)."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.launcher import api as launcher_api

    base = require(launcher_api, "LocalElasticAgent", library="torch", needed_for=_CRASH_BUDGET)
    require(base, "_monitor_workers", library="torch", needed_for=_CRASH_BUDGET)
    require(base, "_exit_barrier", library="torch", needed_for=_FINISHED_WORLD)
    if "LocalElasticAgent" not in launcher_api.launch_agent.__code__.co_names:
        # launch_agent no longer builds its agent from the module global replaced below.
        raise missing("launch_agent's use of torch.distributed.launcher.api.LocalElasticAgent",
                      "torch", _CRASH_BUDGET)
    if getattr(base, "_elastrain", False):
        return
    failed = {agent_api.WorkerState.FAILED, agent_api.WorkerState.UNHEALTHY}

    class ElastrainAgent(base):  # type: ignore[misc, valid-type]
        _elastrain = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            require(self, "_shutdown_timeout", library="torch", owner_name="LocalElasticAgent",
                    needed_for=_RESTART_WAITS)
            require(self, "_store", library="torch", owner_name="SimpleElasticAgent",
                    needed_for=_FINISHED_WORLD)
            self._arrived = False

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state not in failed:
                return result
            if lost := store_lost_of(result.failures or {}):
                worker_group.spec.rdzv_handler.shutdown = lambda: False
                raise StoreLost(lost)
            if config := config_error_of(result.failures or {}):
                worker_group.spec.rdzv_handler.shutdown = lambda: False
                raise WorkerMisconfigured(config)
            if reason := crash_of(result.failures or {}):
                if self._world_finished(worker_group):
                    report_warning(finished_world_warning(reason, worker_group.group_world_size))
                    # Each worker as succeeded (torch records an event per worker from it).
                    return agent_api.RunResult(
                        state=agent_api.WorkerState.SUCCEEDED,
                        return_values={w.global_rank: None for w in worker_group.workers})
                # launch_agent shuts the rendezvous down on any exception but a signal.
                worker_group.spec.rdzv_handler.shutdown = lambda: False
                raise WorkerCrashed(reason)
            return result

        def _world_finished(self, worker_group: Any) -> bool:
            """Every other node of this round finished (see the module docstring)."""
            nodes = worker_group.group_world_size
            if not isinstance(nodes, int) or nodes < 2 or self._store is None:
                return False
            try:
                done = peers_finished(self._store, nodes,
                                      worker_group.spec.rdzv_handler.num_nodes_waiting,
                                      timeout=FINISHED_WAIT_SECONDS)
            except MissingPrivateHook:
                raise
            except Exception:  # the store is gone: no proof the world finished
                return False
            self._arrived = done
            return done

        def _exit_barrier(self) -> None:
            if not self._arrived:  # _world_finished arrived there already
                super()._exit_barrier()

        def _shutdown(self, *args: Any, **kwargs: Any) -> None:
            super()._shutdown(*args, **kwargs)
            global shutdown_exit_codes
            shutdown_exit_codes = exit_codes_of(getattr(self, "_pcontext", None))

    launcher_api.LocalElasticAgent = ElastrainAgent  # type: ignore[attr-defined]


def report_crash(reason: str, path: Path = TERMINATION_LOG) -> None:
    """Say why on stderr and, in a container, in its termination message."""
    print(reason, file=sys.stderr, flush=True)
    if path.exists():
        with contextlib.suppress(OSError):
            path.write_text(reason + "\n")


def report_warning(line: str, path: Path = TERMINATION_LOG) -> None:
    """Say it on stderr and, when the worker left no termination message (its final /progress
    document, elastrain_trainer.metrics), in the container's termination message."""
    print(line, file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        if path.exists() and not path.read_text().strip():
            path.write_text(line + "\n")
