"""Structured stdout: one JSON object per line (step records and lifecycle events).

Humans read these in `kubectl logs`; run_local and the tests parse them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    """Print one JSON line {"event": ..., "time": ..., "pid": ..., **fields} and flush it at
    once. The pid tells a process that went on (an in-process survivor) from its restart."""
    record = {"event": event, "time": round(time.time(), 3), "pid": os.getpid(), **fields}
    sys.stdout.write(json.dumps(record, default=str) + "\n")
    sys.stdout.flush()


def parse_line(line: str) -> dict[str, Any] | None:
    """The record on a line emitted by `emit` (possibly behind a torchrun prefix), else None."""
    start = line.find('{"event"')
    if start < 0:
        return None
    try:
        record = json.loads(line[start:])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None
