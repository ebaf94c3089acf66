"""The warm-start server: an interpreter that imported torch once and forks a child per request.

    python tests/warmstart/server.py SOCKET      (stdin: a pipe from its pytest process)

Run by tests/warmstart/__init__.py, one per pytest process. It imports the heavy third-party
modules every trainer needs (torch, torch.distributed's checkpoint and elastic parts, boto3),
starts no thread (OPENBLAS_NUM_THREADS=1 keeps numpy's BLAS pool from starting one), and then
only accepts requests from shim.py: a command line, an environment, a working directory and the
shim's open file descriptors. For each it forks; the child becomes that command (below) and the
server reports the child's end to the shim, which ends the same way. The server exits when its
pytest process closes its stdin.

The child, before it runs the command: takes the shim's descriptors at the same numbers, its
environment, directory and sys.argv, a sys.path as a fresh interpreter would build it, fresh
stdio objects (-u / PYTHONUNBUFFERED honoured), a fresh `random` seed, torch's thread count
from OMP_NUM_THREADS, sys.executable = the shim (so what it starts goes warm too), and a process
group of its own. A thread watches the shim's connection: when the shim dies (SIGKILL), the
child's group is SIGKILLed, as the group of the process the parent started would have been.
After the child ends, the server SIGKILLs what is left in its group (a DataLoader's workers),
which the launcher's own clean-up would have done to the shim's group.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
from typing import Any

# What every trainer process imports and a warm fork saves (~3 s of CPU per process here).
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.elastic.multiprocessing", "torch.distributed.fsdp",
           "torch.nn.parallel", "torch.utils.data", "boto3", "botocore.session", "fsspec",
           "pydantic", "prometheus_client")
HIGH_FD = 1000  # where descriptors wait while the shim's are put at their numbers
HEADER = struct.Struct("!I")
HERE_FILE = __file__  # read after this module stops being __main__ in the child


def preload() -> None:
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    # The children's collections leave what the server made alone: a collection that walked it
    # would write to every page of it, copying the server's memory into each child.
    gc.freeze()


def receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 253)
    while len(data) < HEADER.size:
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("short request")
        data += more
    (size,) = HEADER.unpack_from(data)
    while len(data) < HEADER.size + size:
        more = conn.recv(1 << 16)
        if not more:
            raise ValueError("short request")
        data += more
    conn.settimeout(None)
    return json.loads(data[HEADER.size:HEADER.size + size]), list(fds)


def note_child(path: str, shim_pid: object, pid: int) -> None:
    """pids/<shim's pid> holds its child's, for a test that compares a PID it started with
    one a trainer reported (tests.warmstart.started_pid). Kept after the child ends."""
    if not isinstance(shim_pid, int):
        return
    directory = os.path.join(os.path.dirname(path), "pids")
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{shim_pid}")
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.replace(tmp, os.path.join(directory, str(shim_pid)))


def note_cpu(request: dict[str, Any], usage: Any) -> None:
    """Under `python -m tests.durations` (ELASTRAIN_TEST_STARTS in the child's environment): one
    file per warm child, as tests/startcount does for a cold start, with the CPU it used (its
    own and its waited-for children's, e.g. a DataLoader's workers)."""
    env = request.get("env") or {}
    directory = env.get("ELASTRAIN_TEST_STARTS")
    if not directory:
        return
    cpu = usage.ru_utime + usage.ru_stime
    record = {"test": env.get("ELASTRAIN_TEST_NODEID", ""), "cmd": [request.get("target")],
              "warm": True, "start": 0}
    with contextlib.suppress(OSError), open(
            os.path.join(directory, f"warm-{os.getpid()}-{id(usage)}-{os.urandom(4).hex()}.jsonl"),
            "w") as f:
        f.write(json.dumps(record) + "\n" + json.dumps({"cpu": cpu}) + "\n")


def reply(conn: socket.socket, message: dict[str, int]) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def serve(path: str) -> tuple[dict[str, Any], list[int], socket.socket] | None:
    """Serve until stdin closes (None); in a forked child, return what it is to become."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(0, selectors.EVENT_READ, "parent")
    # pidfd -> (pid, connection, request)
    children: dict[int, tuple[int, socket.socket, dict[str, Any]]] = {}
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(0, 4096):
                    return None
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for pidfd, (_, other, _) in children.items():
                        os.close(pidfd)
                        other.close()
                    return request, fds, conn
                for fd in fds:
                    os.close(fd)
                note_child(path, request.get("shim_pid"), pid)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn, request)
                selector.register(pidfd, selectors.EVENT_READ, "child")
                reply(conn, {"pid": pid})
            else:
                pid, conn, request = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status, usage = os.wait4(pid, 0)
                note_cpu(request, usage)
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                if os.WIFSIGNALED(status):
                    reply(conn, {"signal": os.WTERMSIG(status)})
                else:
                    reply(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()


def take_descriptors(request: dict[str, Any], fds: list[int], conn: socket.socket) -> socket.socket:
    """Put the shim's descriptors at their numbers; the connection moves out of their way."""
    moved = socket.socket(fileno=fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD_CLOEXEC, HIGH_FD))
    conn.close()
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for fd in fds]
    for fd in fds:
        os.close(fd)
    targets = request["fds"]
    for fd in (0, 1, 2):  # the server's stdio is not the child's
        if fd not in targets:
            with contextlib.suppress(OSError):
                os.close(fd)
    for target, fd, inheritable in zip(targets, parked, request["inheritable"], strict=True):
        os.dup2(fd, target, inheritable=inheritable)
        os.close(fd)
    return moved


def stdio(unbuffered: bool) -> None:
    import io

    def text(fd: int, mode: str, **kw: Any) -> Any:
        try:
            raw = io.FileIO(fd, mode, closefd=False)
        except OSError:
            return None
        binary = raw if unbuffered and mode == "wb" else (
            io.BufferedWriter(raw) if mode == "wb" else io.BufferedReader(raw))
        return io.TextIOWrapper(binary, encoding=os.environ.get("PYTHONIOENCODING") or "utf-8",
                                write_through=unbuffered and mode == "wb", **kw)

    sys.stdin = sys.__stdin__ = text(0, "rb")
    out = text(1, "wb", line_buffering=os.isatty(1))
    sys.stdout = sys.__stdout__ = out
    sys.stderr = sys.__stderr__ = text(2, "wb", errors="backslashreplace", line_buffering=True)


def descendants() -> list[int]:
    """This process's live descendants, whatever their session (torch starts each of a
    launcher's workers in one of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def watch_shim(conn: socket.socket) -> None:
    """The shim died (its connection closed): end this child's group, as its SIGKILL would,
    and its descendants in other sessions, as a pod's end would (a warm launcher's workers:
    a test that SIGKILLs a launcher's shim means the pod; a cold launcher's workers were
    killed by the test's own walk of /proc, which cannot see past the shim)."""
    def watch() -> None:
        with contextlib.suppress(OSError):
            while conn.recv(4096):
                pass
        # Twice: a process started between the first walk and its kills is found by the second.
        for _ in range(2):
            for pid in descendants():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="warmstart-watch", daemon=True).start()


def become(request: dict[str, Any], fds: list[int], conn: socket.socket, base: list[str]) -> None:
    """Turn this forked child into the requested process and run its command."""
    import random
    import types

    os.setpgid(0, 0)
    conn = take_descriptors(request, fds, conn)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    kind, target, args = request["kind"], request["target"], request["args"]
    first = {"module": os.getcwd(), "code": ""}.get(kind)
    if first is None:
        first = os.path.dirname(os.path.realpath(target))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ([] if os.environ.get("PYTHONSAFEPATH") else [first]) + extra + base
    importlib.invalidate_caches()
    sys.executable = request["executable"]
    sys.dont_write_bytecode = request.get("dont_write_bytecode", False) or bool(
        os.environ.get("PYTHONDONTWRITEBYTECODE"))
    stdio(request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
    random.seed()
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    if threads := os.environ.get("OMP_NUM_THREADS"):
        with contextlib.suppress(Exception):
            import torch
            torch.set_num_threads(int(threads))
    watch_shim(conn)
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        run(kind, target, args, main)
    except SystemExit as done:
        code = exit_code(done.code)
    except BaseException as error:
        show(error)
        if isinstance(error, KeyboardInterrupt):  # as Python does: ended by SIGINT
            finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        code = 1
    else:
        code = 0
    finish()
    os._exit(code)


def show(error: BaseException) -> None:
    """The traceback Python would print: the command's frames, not this file's."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == HERE_FILE:
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)


def exit_code(code: object) -> int:
    """What the interpreter makes of SystemExit's argument."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def finish() -> None:
    """An interpreter's exit up to its teardown, which is skipped: tearing down the server's
    modules would touch, and so copy, all of its memory (~1 s per child here). Python waits for
    its threads, runs atexit, flushes stdio."""
    import atexit
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def run(kind: str, target: str, args: list[str], main: Any) -> None:
    import runpy

    if kind == "module":
        sys.argv = ["-m", *args]
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
    elif kind == "code":
        sys.argv = ["-c", *args]
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:
        sys.argv = [target, *args]
        main.__file__ = target
        with open(target, "rb") as f:
            source = f.read()
        exec(compile(source, target, "exec"), main.__dict__)


if __name__ == "__main__":
    # A fresh interpreter's path, less this directory: the child puts its own first entry.
    here = os.path.dirname(os.path.realpath(__file__))
    base_path = [p for p in sys.path if p and os.path.realpath(p) != here]
    preload()
    child = serve(sys.argv[1])
    if child is not None:
        del here
        become(*child, base_path)
