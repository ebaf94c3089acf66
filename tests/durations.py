"""Where the test time goes: a per-module and per-test wall-time breakdown of a pytest run.

    python -m tests.durations [--top N] run -- <pytest args>   # runs pytest, then reports
    python -m tests.durations [--top N] report FILE.xml          # a run's junit XML
    python -m tests.durations [--top N] starts DIR               # a run's process starts

`make test-durations` runs the `make test` tier this way (and the e2e tier with
`make test-durations TIER=e2e`). Besides the times it reports the machine's CPU busy share over
the run (from /proc/stat): a tier whose tests mostly wait (heartbeats, timeouts, servers) has
room for running tests side by side; one whose CPU is busy does not. And how many Python
processes each test started (cold, and warm from tests/warmstart's fork server), how many of
the cold ones imported torch (tests/startcount/: each such start costs 2-3 s of CPU here before
it does anything) and the CPU each test used: its processes' (noted at their exit) and the
pytest process's own. Tests run side by side (pytest-xdist), so a test's wall time says little
of what it costs the run; its CPU does. The run loads this module as a pytest plugin, whose
hook names the running test in the environment the test's processes inherit. The servers'
CPU (apiserver, etcd, MinIO) is nobody's; pods of the e2e tier run in containers and are not
counted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
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
    before = _own_cpu()
    try:
        return (yield)
    finally:
        os.environ.pop(TEST_ENV, None)
        _note_own_cpu(item.nodeid, _own_cpu() - before)


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _note_own_cpu(nodeid: str, cpu: float) -> None:
    """The pytest process's own CPU in a test (its fixtures, its polling), beside its starts."""
    directory = os.environ.get(STARTS_ENV)
    if not directory:
        return
    path = Path(directory) / f"pytest-{os.getpid()}-{len(nodeid)}-{os.urandom(4).hex()}.jsonl"
    with contextlib.suppress(OSError):
        path.write_text(json.dumps({"test": nodeid, "pytest": True}) + "\n"
                        + json.dumps({"cpu": cpu}) + "\n")


class Usage:
    """What one test's processes cost: starts cold and warm, torch imports paid, CPU noted."""

    def __init__(self) -> None:
        self.cold = self.warm = self.torch = self.unnoted = 0
        self.cpu = self.own_cpu = 0.0

    def add(self, lines: list[dict[str, Any]]) -> None:
        head, rest = lines[0], lines[1:]
        cpu = [line["cpu"] for line in rest if "cpu" in line]
        if head.get("pytest"):
            self.own_cpu += sum(cpu)
            return
        if head.get("warm"):
            self.warm += 1
        else:
            self.cold += 1
            self.torch += any("torch" in line for line in rest)
        if cpu:
            self.cpu += sum(cpu)
        else:
            self.unnoted += 1  # killed by a signal before it could note its CPU


    def merge(self, other: Usage) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


def usage(directory: Path) -> dict[str, Usage]:
    """Per test: its processes' starts and CPU (cold starts noted by tests/startcount, warm
    ones by the fork server, the pytest process's own by this module's hook)."""
    per_test: dict[str, Usage] = collections.defaultdict(Usage)
    for path in directory.glob("*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if lines and lines[0].get("test"):
            per_test[lines[0]["test"]].add(lines)
    return per_test


def starts_report(directory: Path, top: int) -> str:
    per_test = usage(directory)
    total = Usage()
    per_module: dict[str, Usage] = collections.defaultdict(Usage)
    for test, u in per_test.items():
        total.merge(u)
        per_module[test.split("::", 1)[0]].merge(u)

    def row(u: Usage, name: str) -> str:
        return (f"  {u.cpu + u.own_cpu:8.1f} {u.cpu:8.1f} {u.own_cpu:7.1f} {u.cold:5d} "
                f"{u.torch:5d} {u.warm:5d} {u.unnoted:5d}  {name}")

    header = (f"  {'cpu s':>8} {'procs':>8} {'pytest':>7} {'cold':>5} {'torch':>5} "
              f"{'warm':>5} {'unnot':>5}")
    lines = [f"Python processes started by tests: {total.cold + total.warm} "
             f"({total.cold} cold, {total.torch} of them imported torch; {total.warm} warm); "
             f"CPU noted: {total.cpu:.0f} s in them, {total.own_cpu:.0f} s in pytest "
             f"({total.unnoted} ended by a signal noted none; servers are not counted)",
             "", "per module (CPU s: all, the tests' processes, pytest's own; starts):", header]
    lines += [row(u, m) for m, u in
              sorted(per_module.items(), key=lambda kv: -(kv[1].cpu + kv[1].own_cpu))]
    lines += ["", f"most CPU, {top} tests:", header]
    lines += [row(u, t) for t, u in
              sorted(per_test.items(), key=lambda kv: -(kv[1].cpu + kv[1].own_cpu))[:top]]
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
