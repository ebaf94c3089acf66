"""tests/durations.py counts the Python processes each test starts and those that import torch
(issue 33's measurement): a real pytest run of two tests that start real interpreters."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

TESTS = '''
import subprocess, sys

def test_starts_a_torch_process_and_a_plain_one():
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_starts_nothing():
    pass
'''


def test_each_tests_python_and_torch_starts_are_counted(tmp_path: Path) -> None:
    (tmp_path / "test_counted.py").write_text(TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "tests.durations", "--top", "5", "run", "--",
         str(tmp_path / "test_counted.py"), "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Python processes started by tests: 2, of which imported torch: 1" in done.stdout, (
        done.stdout)
    assert re.search(r"^ +1  test_counted\.py::test_starts_a_torch_process_and_a_plain_one$",
                     done.stdout, re.MULTILINE), done.stdout
    assert "test_starts_nothing" not in done.stdout.split("most torch starts")[1]
