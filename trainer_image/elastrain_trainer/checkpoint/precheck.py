"""The start-up check of the checkpoint location: before any training, make sure checkpoints can
be written, or say exactly why not.

Each node's local rank 0 does what saving, resuming and retention will do, to one small object
under the checkpoint root (`.elastrain-check/<host>-<pid>`): list, write, read back, delete.
Every rank then takes the same decision (one all_gather per round on the control group), so no
rank trains while another gives up. What the failure means decides what happens
(checkpoint.diagnose):

- The store answered and refused (unknown access key, wrong secret, access denied, no such
  bucket, no credentials at all). Nothing inside this pod can change that (its credentials come
  from its environment, fixed when the container started), so training does not start: the
  reason goes to /progress, where the operator shows it in the CheckpointsFailing condition; the
  trainer waits until that document was read (at most LINGER_SECONDS, and only while it serves
  /progress), then raises CheckpointLocationError, so the process exits 1 and the launcher makes
  the reason the pod's termination message. The operator counts the failed worker against
  restartPolicy.maxRestarts and replaces it after the backoff: a fixed Secret is picked up by the
  replacement, and a wrong one fails the job after a few attempts instead of costing hours of
  training without a checkpoint.
- The store did not answer, or had trouble of its own (connection refused, timeout, 5xx,
  throttling, full). A store briefly down at start must not crash-loop the job, so the check
  retries with backoff (2 s, doubling up to 30 s) for ELASTRAIN_CHECKPOINT_WAIT_SECONDS (default
  600), reporting the reason in /progress meanwhile, and only then fails as above.

A passed check resets the reported failures, which clears the operator's condition.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch.distributed as dist

from elastrain_trainer import metrics
from elastrain_trainer.checkpoint.backends import open_storage
from elastrain_trainer.checkpoint.diagnose import StorageProblem, diagnose, unusable
from elastrain_trainer.checkpoint.storage import CheckpointStorage, join
from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.events import emit

PROBE_DIR = ".elastrain-check"
PROBE = b"elastrain checkpoint location check\n"
FIRST_RETRY_SECONDS = 2.0
MAX_RETRY_SECONDS = 30.0
# How long a trainer that gives up keeps serving its reason for the operator's next poll
# (every ELASTRAIN_PROGRESS_INTERVAL_SECONDS, 15 s by default, plus its 5 s timer).
LINGER_SECONDS = 30.0


class CheckpointLocationError(RuntimeError):
    """Training cannot start: the checkpoint location is unusable.

    Deliberately not a ValueError: the entry point turns those into exit code 2 without the
    torchelastic error file, and the launcher quotes that file in the pod's termination message.
    """


@dataclass(frozen=True)
class Verdict:
    """What one rank saw in one round of the check."""

    problem: StorageProblem | None
    out_of_time: bool = False


def check_location(uri: str, endpoint: str = "") -> StorageProblem | None:
    """None when the location is usable; otherwise the first problem, diagnosed."""
    try:
        storage = open_storage(uri, endpoint)
    except ValueError as e:
        return unusable(uri, e)
    return probe(storage, f"{socket.gethostname()}-{os.getpid()}")


def probe(storage: CheckpointStorage, name: str) -> StorageProblem | None:
    """List, write, read back and delete one small object named `name`."""
    key = join(PROBE_DIR, name)
    steps: list[tuple[str, str, Callable[[], Any]]] = [
        ("list", PROBE_DIR, lambda: storage.list(PROBE_DIR + "/")),
        ("write", key, lambda: storage.write(key, PROBE)),
        ("read", key, lambda: _same(storage.read(key))),
        ("delete", key, lambda: storage.delete([key])),
    ]
    for action, where, step in steps:
        try:
            step()
        except Exception as e:  # every storage error is diagnosed; none escapes
            return diagnose(storage, e, action=action, key=where)
    return None


def _same(data: bytes) -> None:
    if data != PROBE:
        raise OSError(f"read back {len(data)} bytes that differ from the {len(PROBE)} written")


def decide(verdicts: Sequence[Verdict]) -> tuple[StorageProblem | None, bool]:
    """Every rank's verdict -> (the problem to report, give up now?), the same on all ranks.

    A refusal anywhere wins over trouble elsewhere; trouble gives up once any rank ran out of
    time (rank clocks differ a little; the gathered answer does not)."""
    problems = [v.problem for v in verdicts if v.problem is not None]
    if not problems:
        return None, False
    worst = next((p for p in problems if p.permanent), problems[0])
    return worst, worst.permanent or any(v.out_of_time for v in verdicts)


def ensure_checkpoint_location(cfg: TrainerConfig, local_rank: int,
                               group: dist.ProcessGroup | None, *, serving: bool,
                               clock: Callable[[], float] = time.monotonic,
                               sleep: Callable[[float], None] = time.sleep,
                               check: Callable[[str, str], StorageProblem | None] = check_location,
                               ) -> None:
    """Return once every node can use the checkpoint location; raise CheckpointLocationError
    when one cannot (see the module docstring). Collective: every rank calls it."""
    deadline = clock() + cfg.checkpoint_wait_seconds
    delay = FIRST_RETRY_SECONDS
    attempt = 0
    while True:
        attempt += 1
        mine = check(cfg.checkpoint_uri, cfg.checkpoint_endpoint) if local_rank == 0 else None
        problem, stop = decide(_gather(Verdict(mine, clock() + delay > deadline), group))
        if problem is None:
            metrics.record_checkpoint_healthy()
            if local_rank == 0:
                emit("checkpoint_location_ok", uri=cfg.checkpoint_uri, attempts=attempt)
            return
        metrics.record_checkpoint_failed(problem.kind, problem.message)
        if local_rank == 0:
            emit("checkpoint_location_failed", attempt=attempt, kind=problem.kind,
                 permanent=problem.permanent, error=problem.message,
                 retry_in_s=None if stop else delay)
        if stop:
            why = ("checkpoint location unusable" if problem.permanent else
                   f"checkpoint store still failing after {cfg.checkpoint_wait_seconds} s")
            # Short, the reason next: the launcher's one-line crash reason keeps only the start.
            give_up(CheckpointLocationError(f"{why}, training not started: {problem.message}"),
                    local_rank, group, serving=serving)
        sleep(delay)
        delay = min(delay * 2, MAX_RETRY_SECONDS)


def give_up(error: CheckpointLocationError, local_rank: int, group: dist.ProcessGroup | None,
            *, serving: bool) -> NoReturn:
    """Raise `error` on every rank once the operator has read the reason from /progress (its
    CheckpointsFailing condition), at most LINGER_SECONDS. Collective."""
    if serving and local_rank == 0:
        metrics.wait_for_progress_read(metrics.progress_reads(), LINGER_SECONDS)
    if _distributed(group):
        dist.barrier(group=group)  # no rank leaves before the reason was served
    # Raised outside any `except`: a chained store error could read like a lost training peer.
    raise error


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def _gather(mine: Verdict, group: dist.ProcessGroup | None) -> list[Verdict]:
    if not _distributed(group):
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return [v for v in everyone if isinstance(v, Verdict)]
