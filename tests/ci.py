"""CI=true: nothing may skip. Every skip becomes a failure that carries the skip's reason.

Locally a test may skip when what it needs is missing (no helm, no Prometheus, test servers not
built with ELASTRAIN_SKIP_BUILD=1, a reused cluster without fake nodes...), always saying why. In
CI a skip would hide exactly that, so the hooks below (registered by tests/conftest.py) turn
every skip, wherever it comes from (`pytest.skip` in a test or fixture, a `skipif` mark, a
module-level `importorskip`), into a failed test or a collection error with the same reason.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

PREFIX = "skipped under CI=true, where nothing may skip"


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def _reason(longrepr: Any) -> str:
    # A skip's longrepr is (path, line, "Skipped: <reason>").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, line, message = longrepr
        return f"{message} ({path}:{line})"
    return str(longrepr)


def _fail(report: pytest.TestReport | pytest.CollectReport) -> None:
    report.outcome = "failed"
    report.longrepr = f"{PREFIX}: {_reason(report.longrepr)}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        _fail(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector
                               ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if in_ci() and report.skipped:
        _fail(report)
    return report
