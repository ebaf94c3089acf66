"""Test-only faults, armed by a file that a test harness writes, never by environment alone.

The knobs are read only from the file that ELASTRAIN_FAULT_INJECTION_FILE names, one KEY=VALUE a
line (blank lines and `#` comments allowed):

    ELASTRAIN_FAULT_CRASH_AT_STEP=N   raise RuntimeError once step N has trained
    ELASTRAIN_FAULT_CRASH_RANK=R      ... on global rank R only (default: every rank)
    ELASTRAIN_FAULT_CRASH_ONCE=PATH   ... only if PATH does not exist yet (then create it)
    ELASTRAIN_FAULT_GIVE_UP_AT_STEP=N exit EXIT_RESTART once step N has trained, as an
                                      in-process survivor that could not recover does (the
                                      launcher restarts it in place); CRASH_ONCE applies
    ELASTRAIN_FAULT_FREEZE_AFTER_JOIN_REQUEST=1
                                      in-process mode: the worker stops itself (SIGSTOP, every
                                      thread, its heartbeat too) right after it asked to join,
                                      as a pod on a node that stopped answering: planned into
                                      the next generation, it never enters it
    ELASTRAIN_FAULT_FREEZE_AFTER_ARRIVE=1
                                      in-process mode: the same, right after the worker said it
                                      arrived at a generation it was planned into (so the
                                      others are already inside that group's init)
    ELASTRAIN_FAULT_KILL_DURING_HEAL=1
                                      in-process mode: a joiner SIGKILLs itself once its heal
                                      began (the header from its source received, the tensors
                                      not), as a pod lost while it was being healed
    ELASTRAIN_FAULT_FREEZE_DURING_HEAL=1
                                      in-process mode: the same moment, but the joiner stops
                                      itself (SIGSTOP), as a pod whose node went dark while it
                                      was being healed; CRASH_ONCE applies
    ELASTRAIN_FAULT_FREEZE_BEFORE_COMMIT=1
                                      the checkpoint coordinator stops itself (SIGSTOP) right
                                      before it commits a save whose shards are written, as a
                                      node that hangs there; CRASH_ONCE applies (the next
                                      coordinator must not freeze too)
    ELASTRAIN_FAULT_FREEZE_DURING_SAVE=1
                                      a rank other than the checkpoint coordinator stops itself
                                      (SIGSTOP) once it wrote its shards, before it hands their
                                      results to the coordinator, so its peers are inside the
                                      save's collective with a node gone dark; CRASH_ONCE applies
    ELASTRAIN_FAULT_FREEZE_BEFORE_CATALOG=N
                                      rank 0 of a world of at least N ranks stops itself
                                      (SIGSTOP) before it broadcasts the checkpoint catalog (a
                                      save's first step), so its peers wait in that broadcast
                                      with a node gone dark; CRASH_ONCE applies
    ELASTRAIN_FAULT_KILL_IN_BODY_AT_STEP=N
                                      SIGKILL this process at the start of a step's body once N
                                      steps have trained, so its peers meet the loss inside
                                      theirs (a sharded model's collectives in forward and
                                      backward), not at a step boundary
    ELASTRAIN_FAULT_HANG_AT_STEP=N    block forever once step N has trained, as a deadlocked
                                      data loader or a stuck collective would; only in a worker
                                      group that started from scratch (a resumed one trains on)

Why a file: a fault must never fire because a variable reached a worker, copied from a test into
a job's spec.env or left in the shell that runs `elastrain run --local`. The same names set as
environment variables do nothing (the worker says once that it ignores them), and the operator
never renders ELASTRAIN_FAULT_INJECTION_FILE. A file means someone wrote it and put it where the
worker reads it: the integration tests write one under their tmp_path and name it in the
worker's environment (tests/integration/trainer/test_crash_budget.py); the e2e tests put one in a
ConfigMap mounted into the worker pods (tests/e2e/test_faults.py). A user can arm a fault only
as deliberately, by writing such a file into the pod and naming it in spec.env.

Without ELASTRAIN_FAULT_INJECTION_FILE the step loop pays one environment lookup. A named file
that is missing, or holds an unknown key or a value that is not a number, is a configuration
error (ValueError): a harness that meant a fault must not get a run without it.

The end-to-end and integration tests use them to prove the crash budget and the hang watchdog
on real processes; a crash fires again after every resume that trains step N again.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path

FILE_VARIABLE = "ELASTRAIN_FAULT_INJECTION_FILE"
PREFIX = "ELASTRAIN_FAULT_"
CRASH_AT_STEP = "ELASTRAIN_FAULT_CRASH_AT_STEP"
CRASH_RANK = "ELASTRAIN_FAULT_CRASH_RANK"
CRASH_ONCE = "ELASTRAIN_FAULT_CRASH_ONCE"
HANG_AT_STEP = "ELASTRAIN_FAULT_HANG_AT_STEP"
GIVE_UP_AT_STEP = "ELASTRAIN_FAULT_GIVE_UP_AT_STEP"
FREEZE_AFTER_JOIN_REQUEST = "ELASTRAIN_FAULT_FREEZE_AFTER_JOIN_REQUEST"
FREEZE_AFTER_ARRIVE = "ELASTRAIN_FAULT_FREEZE_AFTER_ARRIVE"
KILL_DURING_HEAL = "ELASTRAIN_FAULT_KILL_DURING_HEAL"
KILL_IN_BODY_AT_STEP = "ELASTRAIN_FAULT_KILL_IN_BODY_AT_STEP"
FREEZE_BEFORE_COMMIT = "ELASTRAIN_FAULT_FREEZE_BEFORE_COMMIT"
FREEZE_DURING_SAVE = "ELASTRAIN_FAULT_FREEZE_DURING_SAVE"
FREEZE_DURING_HEAL = "ELASTRAIN_FAULT_FREEZE_DURING_HEAL"
FREEZE_BEFORE_CATALOG = "ELASTRAIN_FAULT_FREEZE_BEFORE_CATALOG"
NUMBERS = (CRASH_AT_STEP, CRASH_RANK, HANG_AT_STEP, GIVE_UP_AT_STEP, FREEZE_AFTER_JOIN_REQUEST,
           FREEZE_AFTER_ARRIVE, KILL_DURING_HEAL, KILL_IN_BODY_AT_STEP, FREEZE_BEFORE_COMMIT,
           FREEZE_DURING_SAVE, FREEZE_DURING_HEAL, FREEZE_BEFORE_CATALOG)
EXIT_RESTART = 75  # signals.EXIT_RESTART (not imported: this module stays free of torch)
KNOBS = (*NUMBERS, CRASH_ONCE)

_ignored_told = False


class InjectedCrash(RuntimeError):
    """The crash ELASTRAIN_FAULT_CRASH_AT_STEP asked for."""


def parse_knobs(text: str, source: str) -> dict[str, str]:
    """The knobs of a fault file's text; ValueError names `source` and what is wrong."""
    knobs: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = (part.strip() for part in line.partition("="))
        if not sep or key not in KNOBS:
            raise ValueError(f"{source}:{number}: {line!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(KNOBS)}")
        if key in NUMBERS and not value.lstrip("-").isdigit():
            raise ValueError(f"{source}:{number}: {key} must be a whole number, not {value!r}")
        knobs[key] = value
    return knobs


@functools.lru_cache(maxsize=4)
def _read(path: str) -> dict[str, str]:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"{FILE_VARIABLE}={path}: cannot read the fault file: {err}") from None
    return parse_knobs(text, path)


def read_knobs(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The armed knobs: those of the file env names, else none (told once if env sets some)."""
    global _ignored_told
    path = env.get(FILE_VARIABLE)
    if path:
        return _read(path)
    if not _ignored_told:
        _ignored_told = True
        if ignored := sorted(k for k in env if k.startswith(PREFIX)):
            print(f"elastrain: ignoring {', '.join(ignored)}: fault injection is read only from "
                  f"the file {FILE_VARIABLE} names (elastrain_trainer.fault_injection)",
                  flush=True)
    return {}


def after_step(step: int, rank: int, *, fresh: bool,
               env: Mapping[str, str] = os.environ) -> None:
    knobs = read_knobs(env)
    if not knobs:
        return
    crash_at = int(knobs.get(CRASH_AT_STEP) or 0)
    crash_rank = int(knobs.get(CRASH_RANK) or -1)
    once = knobs.get(CRASH_ONCE)
    if crash_at and step == crash_at and crash_rank in (-1, rank):
        if not _first_time(once):
            return
        raise InjectedCrash(f"injected crash at step {step} on rank {rank} "
                            f"({CRASH_AT_STEP})")
    give_up = int(knobs.get(GIVE_UP_AT_STEP) or 0)
    if give_up and step == give_up and _first_time(once):
        print(f"elastrain: injected give-up at step {step} ({GIVE_UP_AT_STEP})", flush=True)
        raise SystemExit(EXIT_RESTART)
    hang_at = int(knobs.get(HANG_AT_STEP) or 0)
    if hang_at and step == hang_at and fresh:
        print(f"elastrain: injected hang at step {step} on rank {rank} "
              f"({HANG_AT_STEP})", flush=True)
        threading.Event().wait()


def in_body(step: int, env: Mapping[str, str] = os.environ) -> None:
    """At the start of a step's body, `step` steps trained."""
    kill_at = int(read_knobs(env).get(KILL_IN_BODY_AT_STEP) or 0)
    if kill_at and step == kill_at:
        print(f"elastrain: injected kill in the body after step {step} "
              f"({KILL_IN_BODY_AT_STEP})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def after_join_request(env: Mapping[str, str] = os.environ) -> None:
    _freeze_if(FREEZE_AFTER_JOIN_REQUEST, "after the join request", env)


def after_arrive(env: Mapping[str, str] = os.environ) -> None:
    _freeze_if(FREEZE_AFTER_ARRIVE, "after arriving", env)


def before_commit(env: Mapping[str, str] = os.environ) -> None:
    knobs = read_knobs(env)
    if int(knobs.get(FREEZE_BEFORE_COMMIT) or 0) and _first_time(knobs.get(CRASH_ONCE)):
        _freeze_if(FREEZE_BEFORE_COMMIT, "before the commit", env)


def before_catalog(rank: int, world: int, env: Mapping[str, str] = os.environ) -> None:
    knobs = read_knobs(env)
    at_least = int(knobs.get(FREEZE_BEFORE_CATALOG) or 0)
    if rank == 0 and at_least and world >= at_least and _first_time(knobs.get(CRASH_ONCE)):
        _freeze_if(FREEZE_BEFORE_CATALOG, "before the catalog's broadcast", env)


def during_save(rank: int, env: Mapping[str, str] = os.environ) -> None:
    knobs = read_knobs(env)
    if rank != 0 and int(knobs.get(FREEZE_DURING_SAVE) or 0) \
            and _first_time(knobs.get(CRASH_ONCE)):
        _freeze_if(FREEZE_DURING_SAVE, "during the save", env)


def during_heal(env: Mapping[str, str] = os.environ) -> None:
    knobs = read_knobs(env)
    if int(knobs.get(KILL_DURING_HEAL) or 0):
        print(f"elastrain: injected kill during the heal ({KILL_DURING_HEAL})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if int(knobs.get(FREEZE_DURING_HEAL) or 0) and _first_time(knobs.get(CRASH_ONCE)):
        _freeze_if(FREEZE_DURING_HEAL, "during the heal", env)


def _freeze_if(knob: str, where: str, env: Mapping[str, str]) -> None:
    if int(read_knobs(env).get(knob) or 0):
        print(f"elastrain: injected freeze {where} ({knob})", flush=True)
        # To this thread: it takes the stop itself before it runs another instruction. Sent
        # to the process, another thread may take it, and this one ran on for a while (seen:
        # a commit's next store request and writes went out before the stop).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _first_time(once: str | None) -> bool:
    """False when the fault is armed once (CRASH_ONCE) and already fired."""
    if not once:
        return True
    try:
        Path(once).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True
