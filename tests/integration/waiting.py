"""Waiting on an observable in the integration tiers (never on a fixed time)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import pytest

from elastrain_operator.k8s.client import KubeError

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0,
             interval: float = 0.2) -> T:
    """Poll until probe returns something truthy; fail naming what never happened."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except KubeError as err:
            last = err
        else:
            if last:
                return cast(T, last)
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
