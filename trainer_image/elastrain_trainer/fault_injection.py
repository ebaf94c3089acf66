"""Test-only faults, switched on by environment variables (never by the operator's spec).

    ELASTRAIN_FAULT_CRASH_AT_STEP=N   raise RuntimeError once step N has trained
    ELASTRAIN_FAULT_CRASH_RANK=R      ... on global rank R only (default: every rank)
    ELASTRAIN_FAULT_CRASH_ONCE=PATH   ... only if PATH does not exist yet (then create it)
    ELASTRAIN_FAULT_HANG_AT_STEP=N    block forever once step N has trained, as a deadlocked
                                      data loader or a stuck collective would; only in a worker
                                      group that started from scratch (a resumed one trains on)

The end-to-end and integration tests use them to prove the crash budget and the hang watchdog
on real processes; a crash fires again after every resume that trains step N again.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path


class InjectedCrash(RuntimeError):
    """The crash ELASTRAIN_FAULT_CRASH_AT_STEP asked for."""


def after_step(step: int, rank: int, *, fresh: bool,
               env: Mapping[str, str] = os.environ) -> None:
    crash_at = int(env.get("ELASTRAIN_FAULT_CRASH_AT_STEP") or 0)
    crash_rank = int(env.get("ELASTRAIN_FAULT_CRASH_RANK") or -1)
    once = env.get("ELASTRAIN_FAULT_CRASH_ONCE")
    if crash_at and step == crash_at and crash_rank in (-1, rank):
        if once:
            try:
                Path(once).touch(exist_ok=False)
            except FileExistsError:
                return
        raise InjectedCrash(f"injected crash at step {step} on rank {rank} "
                            "(ELASTRAIN_FAULT_CRASH_AT_STEP)")
    hang_at = int(env.get("ELASTRAIN_FAULT_HANG_AT_STEP") or 0)
    if hang_at and step == hang_at and fresh:
        print(f"elastrain: injected hang at step {step} on rank {rank} "
              "(ELASTRAIN_FAULT_HANG_AT_STEP)", flush=True)
        threading.Event().wait()
