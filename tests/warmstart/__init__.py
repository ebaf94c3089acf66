"""Warm starts: Python processes a test starts are forked from an interpreter that already
imported torch, instead of importing it again (~3 s of CPU each; `make test` starts some 600).

tests/conftest.py calls `install()` in every pytest process that runs tests. It starts
server.py (a fork server, one per pytest process, no threads) and puts shim.py where Python is
looked for: `sys.executable` of the pytest process and torchrun's PYTHON_EXEC (the launcher's
workers) name the shim, and ELASTRAIN_FORKSERVER the server's socket, in os.environ, which the
tests hand to what they start. The shim runs leaf processes warm (the built-in trainer, a
user's script, `python -c`, elastrain's launcher and CLI, torchrun's workers) and execs the
real interpreter for everything else, which is what a test of torchrun or the operator starts
(shim.py's COLD).

What a warm child keeps of the server: the modules it imported (a PYTHONPATH that shadows one
of them is not seen), Python's hash seed, and OpenBLAS's one thread. What differs for the test:
the PID a parent holds is the shim's (signals are relayed, SIGKILL through the child's watch of
the shim, see server.py, which also ends the child's descendants in other sessions; `started_pid`
gives the child's, which is what the process reports as its own) and the child is not its
descendant in /proc. Not for a test about
start-up: ELASTRAIN_WARM_START=0 in a process's environment turns it off for it and what it
starts; in the test run's environment, for the run (`make test-e2e` does).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class WarmStart:
    def __init__(self, directory: Path, real: str) -> None:
        self.socket = directory / "server.sock"
        self.shim = directory / "python"
        self.log = directory / "server.log"
        self.shim.write_text(f"#!{real} -IS\nREAL = {real!r}\n" + (HERE / "shim.py").read_text())
        self.shim.chmod(0o755)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "ELASTRAIN_FORKSERVER",
                            "PYTHON_EXEC")}
        env["OPENBLAS_NUM_THREADS"] = "1"  # numpy would start a BLAS thread, forked half-alive
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([real, str(HERE / "server.py"), str(self.socket)],
                                         stdin=subprocess.PIPE, stdout=log, stderr=log,
                                         env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """The server listens once it imported what it preloads (until then the shim runs
        commands cold)."""
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.socket.parent, ignore_errors=True)


def started_pid(pid: int) -> int:
    """The PID of the process that runs the command a test started as `pid`: the warm child
    when `pid` is a shim's, else `pid` itself."""
    server = os.environ.get("ELASTRAIN_FORKSERVER")
    if not server:
        return pid
    try:
        return int((Path(server).parent / "pids" / str(pid)).read_text())
    except (OSError, ValueError):
        return pid


_REAL = sys.executable  # before install() points sys.executable at the shim


def real_python() -> str:
    """The interpreter the shim stands in for."""
    return _REAL


def install() -> WarmStart | None:
    """Start the server and point this process's Python starts at the shim (None: turned off)."""
    if os.environ.get("ELASTRAIN_WARM_START") == "0":
        return None
    directory = Path(tempfile.mkdtemp(prefix="elastrain-warm-"))
    warm = WarmStart(directory, sys.executable)
    atexit.register(warm.stop)
    os.environ["ELASTRAIN_FORKSERVER"] = str(warm.socket)
    os.environ["PYTHON_EXEC"] = str(warm.shim)
    sys.executable = str(warm.shim)
    return warm
