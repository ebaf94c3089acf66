"""The `python` a test starts while warm starts are on (see tests/warmstart/__init__.py).

Installed with a first line `#!<the real python> -IS` and REAL = that python's path, so it starts
in milliseconds and imports nothing but the standard library. For a command the warm server
can run (below), it hands the server its command line, environment, directory and open
descriptors, relays the signals it gets to the forked child, and ends as the child ended (the
same exit code, or killed by the same signal). For anything else it execs the real python:

- ELASTRAIN_WARM_START=0, or no ELASTRAIN_FORKSERVER in the environment, or the server not
  reachable;
- options other than -u and -B, an interactive start, more descriptors than one message carries;
- `-m` of a program whose test is about its process or that starts servers of its own (COLD):
  it runs cold, and what it starts comes back here (torchrun's PYTHON_EXEC).

elastrain's launcher and CLI run warm (~2 s of CPU each, some 200 per run; the CLI's local
runner starts its launchers through this shim, its sys.executable): a test signals one through
this shim, which relays, and a SIGKILL of this shim ends it and its workers, whatever their
session, as a pod's end would (server.py, watch_shim). A test that walks /proc from it starts
at `tests.warmstart.started_pid`.
"""

# REAL = "<path>" is written above this line when the shim is installed.

import contextlib
import json
import os
import signal
import socket
import struct
import sys

COLD = ("torch.distributed.run", "elastrain_operator", "pytest", "tests.durations", "pip",
        "venv")
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)
MAX_FDS = 253  # SCM_MAX_FD


def cold():  # type: ignore[no-untyped-def]
    os.execv(REAL, [REAL, *sys.argv[1:]])  # type: ignore[name-defined]  # noqa: F821


def parse(args):  # type: ignore[no-untyped-def]
    """What the server is to run, or None for the real python."""
    request = {"unbuffered": False, "dont_write_bytecode": False}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-u":
            request["unbuffered"] = True
        elif arg == "-B":
            request["dont_write_bytecode"] = True
        elif arg in ("-m", "-c") and i + 1 < len(args):
            target = args[i + 1]
            if arg == "-m" and any(target == c or target.startswith(c + ".") for c in COLD):
                return None
            request.update(kind="module" if arg == "-m" else "code", target=target,
                           args=args[i + 2:])
            return request
        elif arg.startswith("-"):
            return None
        else:
            request.update(kind="script", target=arg, args=args[i + 1:])
            return request
        i += 1
    return None


def descriptors(skip):  # type: ignore[no-untyped-def]
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == skip:
            continue
        try:
            os.fstat(fd)
        except OSError:  # listdir's own, closed by now
            continue
        fds.append(fd)
    return sorted(fds)


def main():  # type: ignore[no-untyped-def]
    path = os.environ.get("ELASTRAIN_FORKSERVER")
    request = parse(sys.argv[1:])
    if os.environ.get("ELASTRAIN_WARM_START") == "0" or not path or request is None:
        cold()
    child = []
    pending = []

    def relay(sig, frame):  # type: ignore[no-untyped-def]
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], sig)
        else:
            pending.append(sig)

    for sig in RELAYED:
        signal.signal(sig, relay)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = descriptors(conn.fileno())
    try:
        if len(fds) > MAX_FDS:
            raise OSError("too many descriptors")
        conn.connect(path)
    except OSError:
        for sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        for sig in pending:
            os.kill(os.getpid(), sig)
        cold()
    request.update(env=dict(os.environ), cwd=os.getcwd(), shim_pid=os.getpid(),
                   executable=os.path.abspath(sys.argv[0]), fds=fds,
                   inheritable=[os.get_inheritable(fd) for fd in fds])
    payload = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!I", len(payload))], fds)
    conn.sendall(payload)
    # The child holds them now: a pipe's reader sees its end when the child's copy closes.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd in (0, 1, 2):
            os.dup2(null, fd)
        elif fd != null:
            os.close(fd)
    replies = conn.makefile("rb")
    for line in replies:
        message = json.loads(line)
        if "pid" in message:
            child.append(message["pid"])
            for sig in pending:
                relay(sig, None)
        elif "signal" in message:
            sig = message["signal"]
            if sig != signal.SIGKILL and sig != signal.SIGSTOP:
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)
        else:
            os._exit(message["exit"])
    # The server went away without a word: the child cannot be waited for.
    if child:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child[0], signal.SIGKILL)
    os._exit(1)


main()
