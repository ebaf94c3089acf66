"""The operator's own work queue: which job to look at next, on a few threads of its own.

kopf's handlers only note that a job needs a look (they run on the event loop and return at
once); these threads do the looking. Like client-go's work queue:
- a job is queued at most once however many triggers arrive (they are merged, a progress poll
  requested by any of them included);
- urgent keys (a watch saw a job or one of its children change) always go before routine ones
  (ticker re-checks), so a replacement never waits behind a round of re-checks of idle jobs;
- one job is handled by one thread at a time (JobGate); a trigger during its handling makes it
  run once more;
- a handler that raises is retried after a backoff, as kopf retried its handlers.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from elastrain_operator.reconcile import JobGate

log = logging.getLogger(__name__)
Key = tuple[str, str]
Handler = Callable[[Key, bool], None]  # (job key, poll progress)


class WorkQueue:
    def __init__(self, handle: Handler, *, workers: int, retry_seconds: float) -> None:
        self._handle = handle
        self._retry_seconds = retry_seconds
        self._cond = threading.Condition()
        self._urgent: deque[Key] = deque()
        self._routine: deque[Key] = deque()
        self._queued: dict[Key, bool] = {}  # key -> poll progress
        self._delayed: list[tuple[float, Key, bool]] = []  # (due, key, poll): retries
        self._gate = JobGate()
        self._stopped = False
        self._threads = [threading.Thread(target=self._work, name=f"elastrain-worker-{i}",
                                          daemon=True) for i in range(workers)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def add(self, key: Key, *, urgent: bool, poll: bool = False) -> None:
        with self._cond:
            if key in self._queued:
                self._queued[key] = self._queued[key] or poll
                if not urgent:
                    return
            else:
                self._queued[key] = poll
            (self._urgent if urgent else self._routine).append(key)
            self._cond.notify()

    def depth(self) -> int:
        with self._cond:
            return len(self._queued)

    def _next(self) -> tuple[Key, bool] | None:
        """Under the lock: the next queued key (urgent first); stale deque entries skipped."""
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, key, poll = heapq.heappop(self._delayed)
            self._queued[key] = self._queued.get(key, False) or poll
            self._urgent.append(key)
        for line in (self._urgent, self._routine):
            while line:
                key = line.popleft()
                if key in self._queued:
                    return key, self._queued.pop(key)
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                while (item := self._next()) is None:
                    if self._stopped:
                        return
                    wait = self._delayed[0][0] - time.monotonic() if self._delayed else None
                    self._cond.wait(wait)
                if self._stopped:
                    return
            key, poll = item
            try:
                self._gate.run(key, lambda: self._handle(key, poll))  # noqa: B023
            except Exception:
                log.exception("handling %s/%s failed; retrying in %.0f s", *key,
                              self._retry_seconds)
                with self._cond:
                    heapq.heappush(self._delayed,
                                   (time.monotonic() + self._retry_seconds, key, poll))
                    self._cond.notify()
