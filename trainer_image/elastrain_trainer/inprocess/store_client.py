"""The training thread's client of the job's store, whose requests at a step boundary are bounded
(docs/recovery.md section 7, "A store that stops answering").

A store whose node went dark (every packet dropped, or its process frozen) closes nothing and
answers nothing: a TCPStore request waits out the client's timeout (a minute), and the step
boundary's one request (the coordinator's read of `pending`) held every rank of the world with
it (seen: a store frozen for 15 s stopped three nodes' training for 15.2 s; on a real node a
partition would stop it until the store pod is replaced). So those requests run on a thread of
this module's, and the training thread waits for them at most `within_s`: past it the store is
away, the world trains on without it (as on a store that is gone, section 7), and this client
is given up: a request that timed out leaves its answer to arrive later, where the client would
read it as the answer to its next request. Until the member follows the store again with a new
client (`replace`), every use of `store` raises StoreUnansweredError, a DistError, so each path
that needs the store takes its store-lost branch at once instead of waiting on a dead socket.
The heartbeat thread (its ticks) and the checkpoint fence (its read before a commit) bound their
own requests with BoundedCalls the same way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from elastrain_trainer.events import emit
from elastrain_trainer.inprocess.store import MembershipStore

T = TypeVar("T")
MIN_WITHIN_S = 1.0  # under it a loaded machine's store round trip could pass for a dark store


def within_for(heartbeat_timeout_s: float) -> float:
    """How long a boundary waits for the store: a fifth of the heartbeat timeout (1 s of the
    default 5), at least MIN_WITHIN_S. A false verdict costs little: a beat later the heartbeat
    has heard the store and the member connects again."""
    return max(MIN_WITHIN_S, heartbeat_timeout_s / 5)


class StoreUnansweredError(dist.DistError):
    """The job's store did not answer in time, or was given up since and not followed again."""


class _Call:
    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # handed to the waiting thread, which raises it
            self.error = e
        finally:
            self.done.set()


class _Worker:
    """A daemon thread running calls in order; given up, it ends after the call it is in."""

    def __init__(self, name: str) -> None:
        self.calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (call := self.calls.get()) is not None:
            call.run()


class BoundedCalls:
    """Store requests run on a worker thread and waited for at most `within_s` each: TCPStore's
    own timeouts bound a connect and the server's wait for a missing key, never a request the
    server does not answer (measured: `add`, `check`, `get` and a new client against a frozen
    store all still waited after 25 s, with 2 s timeouts)."""

    def __init__(self, within_s: float, name: str) -> None:
        self.within_s, self.name = within_s, name
        self._worker: _Worker | None = None

    def call(self, fn: Callable[[], T], within_s: float | None = None) -> T:
        """fn's result, or StoreUnansweredError once it took `within_s` (default: the
        calls'): then its worker is given up (fn runs on to its end there, so it must only
        touch what it owns or check `on_current_worker()` before it changes shared state) and
        the next call gets a new one."""
        within = self.within_s if within_s is None else within_s
        if self._worker is None:
            self._worker = _Worker(self.name)
        call = _Call(fn)
        self._worker.calls.put(call)
        started = time.monotonic()
        if not call.done.wait(within) and not (
                # A wait that overran its bound twice over: this process was paused (SIGSTOP,
                # a frozen cgroup) and its worker had no time to run: once more, then judge.
                time.monotonic() - started > 2 * within
                and call.done.wait(within)):
            self._worker.calls.put(None)
            self._worker = None
            raise StoreUnansweredError(f"the job's store did not answer within {within:g} s")
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def on_current_worker(self) -> bool:
        """Whether the calling thread is the worker calls go to now (not one given up)."""
        worker = self._worker
        return worker is not None and worker.thread is threading.current_thread()


class TrainingClient:
    """`store`: the client while it answers; `bounded(fn)`: fn run within `within_s`."""

    def __init__(self, client: MembershipStore, node_id: str, within_s: float) -> None:
        self._client: MembershipStore | None = client
        self.node_id, self.within_s = node_id, within_s
        self._calls = BoundedCalls(within_s, "elastrain-store-calls")
        self.away_since: float | None = None  # monotonic: when the client was given up

    @property
    def store(self) -> MembershipStore:
        if self._client is None:
            raise StoreUnansweredError(f"the job's store did not answer within {self.within_s:g} "
                                       "s; not reached again since")
        return self._client

    def replace(self, client: MembershipStore) -> None:
        """A new client that answered: the store is back for the training thread."""
        self._client, self.away_since = client, None

    def bounded(self, fn: Callable[[], T], within_s: float | None = None) -> T:
        """fn's result; StoreUnansweredError when it takes longer than `within_s` (default:
        the boundary's), and the client is given up (BoundedCalls.call)."""
        try:
            return self._calls.call(fn, within_s)
        except StoreUnansweredError:
            self._give_up(self.within_s if within_s is None else within_s)
            raise

    def current(self) -> bool:
        """Whether the calling thread runs the bounded calls that are waited for now: a call
        given up runs on, and must change no state of the member's once it is not."""
        return self._calls.on_current_worker()

    def _give_up(self, within_s: float) -> None:
        self._client = None
        if self.away_since is None:
            self.away_since = time.monotonic()
            emit("store_unanswered", node=self.node_id, within_s=within_s)
