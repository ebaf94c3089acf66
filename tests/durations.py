"""Where the test time goes: a per-module and per-test wall-time breakdown of a pytest run.

    python -m tests.durations [--top N] run -- <pytest args>   # runs pytest, then reports
    python -m tests.durations [--top N] report FILE.xml          # a run's junit XML
    python -m tests.durations [--top N] starts DIR               # a run's process starts

`make test-durations` runs the `make test` tier this way (and the e2e tier with
`make test-durations TIER=e2e`). Besides the times it reports the machine's CPU busy share over
the run (from /proc/stat): a tier whose tests mostly wait (heartbeats, timeouts, servers) has
room for running tests side by side; one whose CPU is busy does not. And how many Python
processes each test started, and how many of them imported torch (tests/startcount/: each
such start costs 2-3 s of CPU here before it does anything): the run loads this module as a
pytest plugin, whose hook names the running test in the environment the test's processes
inherit. Pods of the e2e tier run in containers and are not counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

STARTS_ENV = "ELASTRAIN_TEST_STARTS"  # where each started Python process notes itself
TEST_ENV = "ELASTRAIN_TEST_NODEID"  # the test running when it started
STARTCOUNT = Path(__file__).resolve().parent / "startcount"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[Any]:
    """(A pytest hook, active when this module is loaded with -p.) The processes a test starts
    (its fixtures' included) inherit its node id."""
    os.environ[TEST_ENV] = item.nodeid
    try:
        return (yield)
    finally:
        os.environ.pop(TEST_ENV, None)


def starts(directory: Path) -> dict[str, list[bool]]:
    """Per test: one entry per Python process it started, True where that process imported
    torch."""
    per_test: dict[str, list[bool]] = collections.defaultdict(list)
    for path in directory.glob("*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if lines and lines[0].get("test"):
            per_test[lines[0]["test"]].append(any("torch" in line for line in lines[1:]))
    return per_test


def starts_report(directory: Path, top: int) -> str:
    per_test = starts(directory)
    python = sum(len(v) for v in per_test.values())
    torch_starts = {test: sum(v) for test, v in per_test.items()}
    per_module: dict[str, int] = collections.Counter()
    for test, n in torch_starts.items():
        per_module[test.split("::", 1)[0]] += n
    lines = [f"Python processes started by tests: {python}, of which imported torch: "
             f"{sum(torch_starts.values())}", "", "torch starts per module:"]
    lines += [f"  {n:6d}  {module}" for module, n in per_module.most_common() if n]
    lines += ["", f"most torch starts, {top} tests:"]
    lines += [f"  {n:6d}  {test}" for test, n in
              sorted(torch_starts.items(), key=lambda kv: -kv[1])[:top] if n]
    return "\n".join(lines)


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def report(xml_path: Path, top: int) -> str:
    cases = ET.parse(xml_path).getroot().iter("testcase")
    per_module: dict[str, list[float]] = collections.defaultdict(list)
    tests: list[tuple[float, str]] = []
    for case in cases:
        seconds = float(case.get("time", "0"))
        module = case.get("classname", "?")
        if module.rsplit(".", 1)[-1].startswith("Test"):  # a test class: its module
            module = module.rsplit(".", 1)[0]
        per_module[module].append(seconds)
        tests.append((seconds, f"{case.get('classname')}::{case.get('name')}"))
    total = sum(s for s, _ in tests)
    lines = [f"{len(tests)} tests, {total:.0f} s in tests", "", "per module (s, tests, share):"]
    for module, times in sorted(per_module.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {sum(times):8.1f}  {len(times):4d}  {sum(times) / max(total, 1e-9):6.1%}"
                     f"  {module}")
    lines += ["", f"slowest {top} tests (s):"]
    lines += [f"  {s:8.1f}  {name}" for s, name in sorted(tests, reverse=True)[:top]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.durations")
    parser.add_argument("--top", type=int, default=60)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("report").add_argument("xml", type=Path)
    sub.add_parser("starts").add_argument("directory", type=Path)
    sub.add_parser("run").add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "report":
        print(report(args.xml, args.top))
        return 0
    if args.command == "starts":  # a run made with the env `run` sets, e.g. CI's own
        print(starts_report(args.directory, args.top))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "times.xml"
        started = Path(tmp) / "starts"
        started.mkdir()
        # A run inside a test (tests/unit/tooling) counts its own starts, not its parent's test.
        env = {k: v for k, v in os.environ.items() if k != TEST_ENV}
        env = {**env, STARTS_ENV: str(started),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(STARTCOUNT),
                                                           os.environ.get("PYTHONPATH")]))}
        busy0, total0 = cpu_times()
        pytest_args = [a for a in args.pytest_args if a != "--"]
        code = subprocess.call([sys.executable, "-m", "pytest", "-p", "tests.durations",
                                *pytest_args, f"--junitxml={xml_path}"], env=env)
        busy1, total1 = cpu_times()
        print(report(xml_path, args.top))
        print(f"\nCPU busy over the run: {(busy1 - busy0) / max(1, total1 - total0):.0%} "
              "of all cores")
        print()
        print(starts_report(started, args.top))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
