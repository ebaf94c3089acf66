"""Warm starts (tests/warmstart): a command run through the shim behaves, for its parent, as the
same command run by a real interpreter: its arguments, environment, directory, path,
descriptors, exit code and signals; only torch is already imported. A server of its own, real
processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.warmstart import WarmStart, real_python

pytestmark = pytest.mark.timeout(120)

@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmStart]:
    server = WarmStart(tmp_path_factory.mktemp("warm"), real_python())
    try:
        assert server.wait_ready(), server.log.read_text()
        yield server
    finally:
        server.stop()


def env(warm: WarmStart, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHON_EXEC")}
    return {**base, "ELASTRAIN_FORKSERVER": str(warm.socket), "ELASTRAIN_WARM_START": "1",
            **extra}


def run(warm: WarmStart, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(warm.shim), *args], capture_output=True, text=True, timeout=60,
                          **kw)  # type: ignore[call-overload, no-any-return]


PROBE = ("import os, sys; print('torch' in sys.modules, sys.argv, os.getcwd(), "
         "os.environ.get('PROBE'), repr(sys.path[0]), __name__, sep='|'); sys.exit(3)")


def test_a_command_runs_in_a_warm_child_with_its_own_args_env_and_directory(
        warm: WarmStart, tmp_path: Path) -> None:
    done = run(warm, "-c", PROBE, "x", "y", env=env(warm, PROBE="yes"), cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip().split("|") == [
        "True", "['-c', 'x', 'y']", str(tmp_path), "yes", "''", "__main__"]


def test_off_or_an_option_it_does_not_know_runs_the_real_interpreter(warm: WarmStart) -> None:
    off = run(warm, "-c", PROBE, env=env(warm, ELASTRAIN_WARM_START="0"))
    assert off.returncode == 3 and off.stdout.startswith("False|"), off.stderr
    dev = run(warm, "-X", "dev", "-c", "import sys; print('torch' in sys.modules, "
              "sys.flags.dev_mode)", env=env(warm))
    assert dev.stdout.split() == ["False", "True"], dev.stderr


def test_a_script_and_a_module_get_the_path_a_fresh_interpreter_builds(
        warm: WarmStart, tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helper.py").write_text("WHO = 'helper from PYTHONPATH'\n")
    script = tmp_path / "scripts" / "main.py"
    script.parent.mkdir()
    script.write_text("import sys, helper\nprint(helper.WHO, sys.path[0], __file__, sys.argv)\n"
                      "raise SystemExit(0)\n")
    done = run(warm, str(script), "--flag", env=env(warm, PYTHONPATH=str(lib)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["helper", "from", "PYTHONPATH", str(script.parent),
                                   str(script), f"['{script}',", "'--flag']"]
    (tmp_path / "mymod.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    module = run(warm, "-m", "mymod", "a", env=env(warm), cwd=tmp_path)
    assert module.stdout.split() == ["__main__", "['a']"], module.stderr


def test_an_uncaught_error_prints_the_commands_traceback_and_exits_1(warm: WarmStart) -> None:
    done = run(warm, "-c", "def f():\n    raise ValueError('boom')\nf()", env=env(warm))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "Traceback (most recent call last):", '  File "<string>", line 3, in <module>',
        '  File "<string>", line 2, in f', "ValueError: boom"]


def test_stdin_and_a_passed_descriptor_reach_the_child(warm: WarmStart) -> None:
    read, write = os.pipe()
    try:
        done = subprocess.run(
            [str(warm.shim), "-c", f"import os, sys; os.write({write}, sys.stdin.read().upper()"
             ".encode())"], input="piped", capture_output=True, text=True, env=env(warm),
            pass_fds=(write,), timeout=60)
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert os.read(read, 100) == b"PIPED"
    os.close(read)


def child_pid(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    return int(proc.stdout.readline())


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


SLEEPER = ("import os, signal, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *a: (print('term', flush=True), sys.exit(7)))\n"
           "print(os.getpid(), flush=True)\n"
           "time.sleep(60)\n")


def test_signals_reach_the_child_and_its_end_is_the_shims(warm: WarmStart) -> None:
    term = subprocess.Popen([str(warm.shim), "-c", SLEEPER], stdout=subprocess.PIPE, text=True,
                            env=env(warm))
    child_pid(term)
    term.send_signal(signal.SIGTERM)
    assert term.wait(30) == 7
    assert term.stdout is not None and term.stdout.read().strip() == "term"
    killed = subprocess.Popen([str(warm.shim), "-c", SLEEPER], stdout=subprocess.PIPE,
                              text=True, env=env(warm))
    os.kill(child_pid(killed), signal.SIGKILL)  # the real process, as a test's os.kill does
    assert killed.wait(30) == -signal.SIGKILL


def with_a_forked_helper(warm: WarmStart, then: str) -> subprocess.Popen[str]:
    """A warm child that forks a helper into its group (as a DataLoader worker is), then runs
    `then` (`kid` is the helper's PID)."""
    code = ("import os, time\n"
            "kid = os.fork()\n"
            "if kid == 0:\n    time.sleep(60)\n    os._exit(0)\n" + then)
    return subprocess.Popen([str(warm.shim), "-c", code], stdout=subprocess.PIPE, text=True,
                            env=env(warm))


def test_a_sigkilled_shim_takes_its_child_and_its_childs_group_with_it(
        warm: WarmStart) -> None:
    proc = with_a_forked_helper(warm, "print(os.getpid(), flush=True)\nprint(kid, flush=True)\n"
                                "time.sleep(60)\n")
    child, grandchild = child_pid(proc), child_pid(proc)
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
    assert gone(child) and gone(grandchild)


def test_what_a_finished_child_left_in_its_group_is_ended(warm: WarmStart) -> None:
    proc = with_a_forked_helper(warm, "print(kid, flush=True)\n")
    left = child_pid(proc)
    assert proc.wait(30) == 0
    assert gone(left)


def test_a_sigkilled_shim_takes_its_childs_descendants_in_other_sessions_with_it(
        warm: WarmStart) -> None:
    """As a warm launcher's workers are (torch starts each in a session of its own): a test
    that SIGKILLs the launcher's shim ends the pod, and /proc cannot lead it past the shim."""
    code = ("import os, subprocess, time\n"
            "helper = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
            "print(helper.pid, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([str(warm.shim), "-c", code], stdout=subprocess.PIPE, text=True,
                            env=env(warm))
    helper = child_pid(proc)
    assert not gone(helper, timeout=0.5)
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
    assert gone(helper)
