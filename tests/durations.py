"""Where the test time goes: a per-module and per-test wall-time breakdown of a pytest run.

    python -m tests.durations [--top N] run -- <pytest args>   # runs pytest, then reports
    python -m tests.durations [--top N] report FILE.xml          # a run's junit XML

`make test-durations` runs the `make test` tier this way (and the e2e tier with
`make test-durations TIER=e2e`). Besides the times it reports the machine's CPU busy share over
the run (from /proc/stat): a tier whose tests mostly wait (heartbeats, timeouts, servers) has
room for running tests side by side; one whose CPU is busy does not.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path


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
    sub.add_parser("run").add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "report":
        print(report(args.xml, args.top))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "times.xml"
        busy0, total0 = cpu_times()
        pytest_args = [a for a in args.pytest_args if a != "--"]
        code = subprocess.call([sys.executable, "-m", "pytest", *pytest_args,
                                f"--junitxml={xml_path}"])
        busy1, total1 = cpu_times()
        print(report(xml_path, args.top))
        print(f"\nCPU busy over the run: {(busy1 - busy0) / max(1, total1 - total0):.0%} "
              "of all cores")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
