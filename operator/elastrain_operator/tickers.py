"""Which per-job tickers run: one per live TrainingJob, stopped by the job's DELETED event.

kopf runs each ticker as a daemon (handlers.job_ticker), so kopf starts it, stops it while
peering pauses this replica, and stops it when the operator exits. But kopf stops a daemon on
deletion only when it sees a deletionTimestamp, and a job gets one only while a finalizer holds
it; the ticker is registered without kopf's finalizer (see handlers.daemon_without_finalizer),
so a deleted job simply vanished with a DELETED event, kopf forgot the job, and its daemon ran
on forever (kopf#390: the reason kopf puts a finalizer on every object a daemon runs for).

So the job's watch events say here which jobs (key and uid) are live, and a ticker runs only
for one of them: it registers at its start (refused for a job already gone: kopf spawns a job's
daemons after its event handlers, so a job created and deleted within one batch of events is
seen DELETED first) and waits on the stop event it gets, which the job's DELETED event sets.
By uid, not by name alone: kopf handles each uid's events in order but different uids'
concurrently, so a job re-created under the same name can be seen before its predecessor's
DELETED event. Everything here runs on kopf's event loop: no lock.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from elastrain_operator import metrics

Key = tuple[str, str]  # (namespace, job name)


@dataclass
class Tickers:
    _live: set[tuple[Key, str]] = field(default_factory=set)  # (key, uid) of jobs seen
    _running: dict[tuple[Key, str], asyncio.Event] = field(default_factory=dict)

    def job_seen(self, key: Key, uid: str) -> None:
        self._live.add((key, uid))

    def job_gone(self, key: Key, uid: str) -> None:
        """The job's DELETED event: its ticker stops and nothing of it stays here."""
        self._live.discard((key, uid))
        stop = self._running.get((key, uid))
        if stop is not None:
            stop.set()

    def start(self, key: Key, uid: str) -> asyncio.Event | None:
        """A ticker starting for job `uid`: the event that tells it to stop, or None when it
        must not run (that job is gone, or already has its ticker)."""
        if (key, uid) not in self._live or (key, uid) in self._running:
            return None
        stop = self._running[(key, uid)] = asyncio.Event()
        metrics.record_tickers(len(self._running))
        return stop

    def finished(self, key: Key, uid: str) -> None:
        """A ticker returned (stopped here or by kopf): forget it."""
        self._running.pop((key, uid), None)
        metrics.record_tickers(len(self._running))

    def count(self) -> int:
        return len(self._running)
