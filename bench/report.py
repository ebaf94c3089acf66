"""What every real-node benchmark writes at its end: the machine it ran on, the summary printed,
the whole result as JSON under bench/results/, and where its logs are."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    return {"cpus": len(os.sched_getaffinity(0)), "kernel": platform.release(),
            "python": platform.python_version()}


def write(out: Path, result: dict[str, Any], shown: Any, workdir: Path) -> int:
    """Print `shown`, write `result` to `out`; the bench's exit code."""
    print(json.dumps(shown, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"logs: {workdir}", file=sys.stderr)
    return 0
