"""Counts Python interpreter starts for `python -m tests.durations` (test-only, never imported
otherwise): the durations run puts this directory first on PYTHONPATH and names a directory in
ELASTRAIN_TEST_STARTS, so every Python process a test starts (torchrun agents, trainers,
scripts, helpers) writes one file there: the test that was running (ELASTRAIN_TEST_NODEID, set
by tests/durations.py's hook around each test), its command line, and whether it imported
torch (a finder first on sys.meta_path notes the import and finds nothing itself), and at a
clean exit the CPU it used. Processes forked without exec (DataLoader workers) are not starts
and are not counted; warm starts (tests/warmstart) are noted by the fork server instead, with
their CPU, since a forked child runs no sitecustomize.

It shadows Debian's own sitecustomize (apport's crash hook), which it runs first if present.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import resource
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
_path = list(sys.path)
try:  # the sitecustomize this one shadows, if any
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    _spec = importlib.util.find_spec("sitecustomize")
    if _spec is not None and _spec.loader is not None and _spec.origin != __file__:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
except Exception:  # counting must never break a process
    pass
finally:
    sys.path = _path

_dir = os.environ.get("ELASTRAIN_TEST_STARTS")


class _TorchImportNote:
    """Notes the first `import torch` of this process; finds nothing."""

    def __init__(self, path: str) -> None:
        self.path, self.noted = path, False

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torch" and not self.noted:
            self.noted = True
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"torch": time.time()}) + "\n")
            except OSError:
                pass


def _note_cpu(path: str) -> None:
    """This process's own CPU at a clean exit (a process killed by a signal notes none)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"cpu": usage.ru_utime + usage.ru_stime}) + "\n")
    except OSError:
        pass


if _dir:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            _cmd = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        _file = os.path.join(_dir, f"{os.getpid()}-{time.monotonic_ns()}.jsonl")
        with open(_file, "w") as f:
            f.write(json.dumps({"test": os.environ.get("ELASTRAIN_TEST_NODEID", ""),
                                "cmd": _cmd[:6], "start": time.time()}) + "\n")
        sys.meta_path.insert(0, _TorchImportNote(_file))  # type: ignore[arg-type]
        atexit.register(_note_cpu, _file)
    except OSError:
        pass
