"""tests/durations.py counts the Python processes each test starts, those that import torch and
the CPU they and the pytest process used (issue 33's measurement): a real pytest run of tests
that start real interpreters, cold and warm (tests/warmstart's fork server)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

TESTS = '''
import os, subprocess, sys
from tests import warmstart

def test_starts_a_torch_process_and_a_plain_one():
    real = warmstart.real_python()
    subprocess.run([real, "-c", "import torch"], check=True)
    subprocess.run([real, "-c", "pass"], check=True)

def test_starts_a_busy_warm_child():
    assert os.environ.get("ELASTRAIN_FORKSERVER")
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3 * 10**7))"], check=True)

def test_starts_nothing():
    pass
'''

CONFTEST = '''
from tests import warmstart

def pytest_configure(config):
    warm = warmstart.install()
    assert warm is not None and warm.wait_ready()
'''


def row(stdout: str, test: str) -> list[str]:
    """The numbers of a test's row in the 'most CPU' table."""
    table = stdout.split("most CPU")[1]
    match = re.search(rf"^ +(.*?)  test_counted\.py::{test}$", table, re.MULTILINE)
    assert match, stdout
    return match.group(1).split()


def test_each_tests_starts_torch_imports_and_cpu_are_counted(tmp_path: Path) -> None:
    (tmp_path / "test_counted.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("ELASTRAIN_FORKSERVER", "PYTHON_EXEC", "ELASTRAIN_WARM_START")}
    done = subprocess.run(
        [sys.executable, "-m", "tests.durations", "--top", "5", "run", "--",
         str(tmp_path / "test_counted.py"), "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("Python processes started by tests: 3 (2 cold, 1 of them imported torch; 1 warm)"
            in done.stdout), done.stdout
    # cpu s, procs, pytest, cold, torch, warm, unnoted
    cold = row(done.stdout, "test_starts_a_torch_process_and_a_plain_one")
    assert cold[3:] == ["2", "1", "0", "0"], cold
    warm = row(done.stdout, "test_starts_a_busy_warm_child")
    assert warm[3:] == ["0", "0", "1", "0"], warm
    assert float(warm[1]) >= 0.5, warm  # the child's own CPU, noted by the fork server
    assert float(cold[1]) >= 0.5, cold  # importing torch
    idle = row(done.stdout, "test_starts_nothing")
    assert idle[3:] == ["0", "0", "0", "0"], idle
