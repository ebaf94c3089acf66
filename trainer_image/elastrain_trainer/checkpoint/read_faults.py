"""What a failed checkpoint read proves, and how long to keep trying.

Only proof of damage skips a checkpoint: a checksum or size that does not match the manifest, a
missing or invalid commit marker or manifest, an object the manifest names that is not there
(CorruptCheckpointError). A store that is slow, throttles, resets connections or answers 5xx
proves nothing about the checkpoint: the read is tried again, with backoff and jitter, for
ELASTRAIN_CHECKPOINT_WAIT_SECONDS; then the worker stops with the reason, and the next attempt
starts over from the newest checkpoint. Anything else (a store that refuses the credentials, a
checkpoint that does not fit the model) stops at once: waiting cannot fix it, and falling back
past it would lose work.

The decision is the same on every rank: rank-0-only reads share their outcome, DCP raises the
same CheckpointException on every rank, and rank 0's clock decides when to give up.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch.distributed.checkpoint.api import CheckpointException

from elastrain_trainer.checkpoint.diagnose import diagnose
from elastrain_trainer.checkpoint.manifest import CorruptCheckpointError
from elastrain_trainer.checkpoint.precheck import CheckpointLocationError
from elastrain_trainer.checkpoint.problems import OTHER
from elastrain_trainer.checkpoint.storage import CheckpointStorage

T = TypeVar("T")
FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 15.0
INCOMPATIBLE = "incompatible"  # a `kind` beside checkpoint.problems.KINDS: not the store's fault


class StoreFault(RuntimeError):
    """A storage call failed without proving the checkpoint damaged (raised inside DCP's read, so
    that every rank sees what it was). Plain arguments: DCP pickles it to the other ranks."""

    def __init__(self, message: str, kind: str = OTHER, permanent: bool = False) -> None:
        super().__init__(message, kind, permanent)
        self.message, self.kind, self.permanent = message, kind, permanent

    def __str__(self) -> str:
        return self.message


class CheckpointUnavailableError(CheckpointLocationError):
    """The newest checkpoint could not be read; the worker stops instead of falling back past it
    (or starting over). The next start tries again from the newest checkpoint."""


@dataclass(frozen=True)
class Ok(Generic[T]):
    value: T


@dataclass(frozen=True)
class Damaged:
    reason: str


@dataclass(frozen=True)
class Failed:
    """Not proof of damage: `transient` faults are retried; the others stop the worker."""

    kind: str
    message: str
    transient: bool


Outcome = Ok[Any] | Damaged | Failed


def store_fault(storage: CheckpointStorage, error: BaseException, *, action: str,
                key: str) -> StoreFault:
    problem = diagnose(storage, error, action=action, key=key)
    return StoreFault(problem.message, problem.kind, problem.permanent)


def classify(error: BaseException, storage: CheckpointStorage, *, action: str, key: str,
             storage_call: bool) -> Damaged | Failed:
    """What an exception from a checkpoint read means (see the module docstring).
    `storage_call`: the exception came straight from a storage call (a listing, a marker read),
    so anything but damage is the store's; inside DCP, dcp_io has already wrapped those."""
    if isinstance(error, CheckpointException):
        ranks = [exc for _rank, (exc, _tb) in sorted(error.failures.items())]
        return _classify_ranks(ranks, storage, action=action, key=key)
    if isinstance(error, CorruptCheckpointError):
        return Damaged(str(error))
    if isinstance(error, StoreFault):
        return Failed(error.kind, error.message, not error.permanent)
    if storage_call:
        fault = store_fault(storage, error, action=action, key=key)
        return Failed(fault.kind, fault.message, not fault.permanent)
    return Failed(INCOMPATIBLE, f"{type(error).__name__}: {error}", False)


def _classify_ranks(errors: list[BaseException], storage: CheckpointStorage, *, action: str,
                    key: str) -> Damaged | Failed:
    """Every rank's failure -> one outcome: damage anywhere is proof; a fault that waiting
    cannot fix stops; otherwise retry."""
    outcomes = [classify(e, storage, action=action, key=key, storage_call=False)
                for e in errors]
    for outcome in outcomes:
        if isinstance(outcome, Damaged):
            return outcome
    failed = [o for o in outcomes if isinstance(o, Failed)]
    if not failed:
        return Failed(OTHER, "checkpoint load failed on some rank without an error", True)
    return next((o for o in failed if not o.transient), failed[0])


def attempt(fn: Callable[[], T], storage: CheckpointStorage, *, action: str, key: str,
            storage_call: bool) -> Outcome:
    try:
        return Ok(fn())
    except (Exception, CheckpointException) as e:  # DCP raises a BaseException subclass
        return classify(e, storage, action=action, key=key, storage_call=storage_call)


@dataclass(frozen=True)
class Retry:
    """Rank 0's decision after a failure: sleep this long, or give up (seconds is None)."""

    seconds: float | None


def plan_retry(failed: Failed, *, now: float, deadline: float, delay: float,
               rng: Callable[[], float] = random.random) -> Retry:
    """Jitter over the upper half of the backoff (workers of many jobs that all resume after one
    preemption wave spread out instead of retrying in step); the last try is at the deadline."""
    if not failed.transient or now >= deadline:
        return Retry(None)
    return Retry(min(delay / 2 + rng() * delay / 2, max(0.0, deadline - now)))


def next_delay(delay: float) -> float:
    return min(delay * 2, MAX_RETRY_SECONDS)
