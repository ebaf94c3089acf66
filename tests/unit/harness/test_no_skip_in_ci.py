"""With CI=true every kind of skip fails with its reason (tests/ci.py, through tests/conftest.py);
without it, skips stay skips. Runs a throwaway pytest session over sample tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PREFIX = "skipped under CI=true, where nothing may skip: Skipped:"

SAMPLE = '''
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("no helm here")

@pytest.mark.skipif(True, reason="marked away")
def test_marked():
    pass

@pytest.fixture
def server():
    pytest.skip("server not built")

def test_fixture_skips(server):
    pass

@pytest.mark.xfail(reason="known bug")
def test_xfails():
    assert False
'''
MODULE_LEVEL = '''
import pytest
pytest.importorskip("no_such_module_for_elastrain")

def test_never_collected():
    pass
'''


def session(tmp_path: Path, *, ci: str | None) -> dict[str, str]:
    """Each sample test's (or module's) short summary line, keyed by its name."""
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_module_level.py").write_text(MODULE_LEVEL)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    # The real tests/conftest.py as a plugin: the hooks reach the samples as they reach tests/.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-rA", "-q", "--continue-on-collection-errors", "--rootdir", str(tmp_path),
         str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines: dict[str, str] = {}
    for line in done.stdout.splitlines():
        outcome, _, rest = line.partition(" ")
        if outcome in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"):
            name = rest.split(" - ")[0].split("::")[-1].split("/")[-1]
            if outcome == "SKIPPED":  # "[1] path:line: reason"
                name = rest.split(": ")[-1]
            lines[name] = f"{outcome} {rest}"
    return lines


def test_every_skip_fails_with_its_reason_under_ci(tmp_path: Path) -> None:
    lines = session(tmp_path, ci="true")
    assert lines["test_passes"].startswith("PASSED")
    assert lines["test_xfails"].startswith("XFAIL")  # an expected failure is no skip
    for name, kind, reason in [("test_skips", "FAILED", "no helm here"),
                               ("test_marked", "ERROR", "marked away"),
                               ("test_fixture_skips", "ERROR", "server not built"),
                               ("test_module_level.py", "ERROR",
                                "could not import 'no_such_module_for_elastrain'")]:
        assert lines[name].startswith(kind), lines
        assert f"{PREFIX} {reason}" in lines[name], lines[name]
    assert not any(line.startswith("SKIPPED") for line in lines.values()), lines


@pytest.mark.parametrize("ci", [None, "false", "1"])
def test_outside_ci_skips_stay_skips(tmp_path: Path, ci: str | None) -> None:
    lines = session(tmp_path, ci=ci)
    assert lines["test_passes"].startswith("PASSED")
    for reason in ("no helm here", "marked away", "server not built"):
        assert lines[reason].startswith("SKIPPED"), lines
    assert not any(line.startswith(("FAILED", "ERROR")) for line in lines.values()), lines
