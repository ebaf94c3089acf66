"""Telling a worker's own crash from a lost peer: the crash budget depends on it.

A worker process ends in one of these ways, and only the last one is the job's fault:

- exit 0: training finished, or this rank was signalled and saved (signals.StopAgreement);
- exit EXIT_RESTART (75): "restart me": a survivor of a SIGTERM stop, or a rank whose
  collective failed because a peer went away (guard_main turns such errors into 75);
- killed by SIGTERM/SIGINT/SIGHUP: someone stopped it (its agent, a user);
- exit EXIT_CONFIG (78, sysexits' EX_CONFIG): a configuration error that no restart can fix (a
  dataset file the trainer cannot read, a vocabulary too small, an invalid setting: a ValueError
  raised by elastrain_trainer's own code, see is_configuration_error); the job fails at once;
- anything else: a crash of the job's own making (an exception in the training code, an
  assertion, a NaN guard giving up, a segfault, the OOM killer's SIGKILL).

The launcher (elastrain_trainer.launch) restarts the worker group in place for the first
three, as torchrun does, and for a crash stops the node with a one-line reason that the
operator counts against restartPolicy.maxRestarts (see launch/agent.py). The reason comes from the
worker's torchelastic error file, which guard_main writes; a user script that uses neither
guard_main nor torch's `@record` still gets its crash counted, with its exit code only.

A configuration error is one line starting CONFIG_PREFIX, in the worker's log, in the launcher's
termination message and in local mode's log: the operator (policy/failures.py) and local mode's
supervisor (launch/supervise.py) fail the job on it at once, quoting the rest of the line.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Callable
from typing import Final

from elastrain_trainer.signals import EXIT_RESTART

CRASH_PREFIX: Final = "elastrain: worker crashed: "
CONFIG_PREFIX: Final = "elastrain: configuration error: "
# A node that ended 0 despite a fault (a worker dead after every node finished training).
WARNING_PREFIX: Final = "elastrain: warning: "
EXIT_CONFIG: Final = 78
_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__))
_ERROR_TYPE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")
# What gloo, NCCL and c10d stores raise when the other side of a collective went away (seen
# with gloo: "[.../gloo/transport/tcp/pair.cc:545] Read error ...: Connection reset by peer").
_PEER_LOST = re.compile(
    r"gloo/transport|Connection (reset|closed) by peer|Broken pipe|Socket Timeout|"
    r"NCCL communicator was aborted|ncclRemoteError|ncclSystemError|remote process exited|"
    r"Watchdog caught collective operation timeout|DistNetworkError|DistStoreError|"
    r"RendezvousConnectionError|RendezvousClosedError",
    re.IGNORECASE)
_STOP_SIGNALS: Final = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def peer_lost(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) says a peer or the store went away."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _PEER_LOST.search(f"{type(current).__name__}: {current}"):
            return True
        current = current.__cause__ or current.__context__
    return False


def peer_lost_message(message: str) -> bool:
    return bool(_PEER_LOST.search(message))


def is_configuration_error(exc: BaseException) -> bool:
    """A ValueError raised by elastrain_trainer's own code: its settings, data files or API
    (the trainer's convention for user errors). One raised inside torch or a user's code while
    training is a crash like any other."""
    if not isinstance(exc, ValueError) or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def config_reason(message: str, limit: int = 400) -> str:
    """The one line that fails a job for a configuration error (kept short: the operator
    quotes it; kubelet keeps 4 KiB of a termination message)."""
    return CONFIG_PREFIX + reason_of(message, limit)


def is_crash(exitcode: int, message: str = "") -> bool:
    """Whether a worker process's end is the job's own crash (see the module docstring).

    exitcode is the process's (negative: killed by that signal); message is its error file's.
    """
    if exitcode in (0, EXIT_RESTART):
        return False
    if exitcode < 0:
        return -exitcode not in {int(s) for s in _STOP_SIGNALS}
    return not peer_lost_message(message)


def crash_reason(exitcode: int, message: str, rank: int) -> str:
    """One line for the pod's termination message, events and status (kept short)."""
    what = " ".join(message.split())[:400] if message and message != "<N/A>" else ""
    if exitcode < 0:
        how = f"killed by {signal.Signals(-exitcode).name}" if -exitcode in _SIGNALS else (
            f"killed by signal {-exitcode}")
        if exitcode == -signal.SIGKILL:
            how += " (out of memory?)"
    else:
        how = f"exit code {exitcode}"
    return f"{CRASH_PREFIX}rank {rank}, {how}" + (f": {what}" if what else "")


_SIGNALS: Final = frozenset(int(s) for s in signal.Signals)


def guard_main(main: Callable[[], int]) -> int:
    """Run a worker's main: a lost peer exits EXIT_RESTART; a configuration error is recorded
    and exits EXIT_CONFIG; a crash is recorded and exits 1.

    The record is torch's error file (TORCHELASTIC_ERROR_FILE, set by the agent), so the
    launcher can quote the exception in the crash reason.
    """
    try:
        return main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # every exception is classified, then reported
        if peer_lost(e):
            print(f"elastrain: a peer or the store went away ({type(e).__name__}: "
                  f"{' '.join(str(e).split())[:300]}); restarting the worker group",
                  file=sys.stderr, flush=True)
            return EXIT_RESTART
        if is_configuration_error(e):
            print(config_reason(str(e)), file=sys.stderr, flush=True)
            _record(e)
            return EXIT_CONFIG
        import traceback

        traceback.print_exc()
        _record(e)
        return 1


def record_reason(reason: str) -> None:
    """Leave `reason` in torch's error file for a worker that ends with an exit code of its
    own (EXIT_STORE_LOST), so the launcher can quote it; `reason_of` reads it back."""
    _record(RuntimeError(reason))


def reason_of(message: str, limit: int = 300) -> str:
    """An error file's message as one short line, without the exception's type."""
    what = _ERROR_TYPE.sub("", " ".join(message.split()))
    return what if len(what) <= limit else what[:limit - 3] + "..."


def _record(exc: BaseException) -> None:
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
    except Exception as err:  # reporting must not hide the crash itself
        print(f"elastrain: could not write the error file: {err}", file=sys.stderr)
