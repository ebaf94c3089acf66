"""A deleted job leaves nothing running: create/delete churn against the real apiserver.

kopf stops a daemon when it sees a deletionTimestamp, which a job without finalizers never
gets; the tickers used to outlive their jobs (the operator idled at 9% of a core after 300
jobs were created and deleted). The operator (a subprocess, as in production) is read through
its /metrics: `elastrain_operator_tickers` is the number of per-job tickers running, and its
resident memory is read from /proc.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import free_port, scrape
from tests.integration.operator.conftest import Cluster, Operator, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
CYCLES = 200
WARMUP = 60  # cycles before the memory baseline: imports, caches, pools and arenas fill up
KEEP = ("keep-0", "keep-1", "keep-2")  # live throughout: their tickers must survive the churn
# 20 KiB a cycle: a leak of anything job-sized per cycle shows (a leaked ticker held ~30 KB:
# its job's body, kopf's memory of the job, a task); the allocator's own growth measured
# ~1.5 MiB over these cycles while Python's heap (tracemalloc) did not grow.
MAX_GROWTH_BYTES = CYCLES * 20 * 1024


def tickers(port: int) -> float | None:
    samples = scrape(port)
    return None if samples is None else samples.get("elastrain_operator_tickers")


def rss_bytes(op: Operator) -> int:
    assert op.proc is not None
    for line in Path(f"/proc/{op.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def await_tickers(port: int, expected: int, why: str) -> None:
    seen: list[float | None] = [None]

    def probe() -> bool:
        seen[0] = tickers(port)
        return seen[0] == expected

    try:
        wait_for(f"{expected} tickers ({why})", probe, timeout=60)
    except pytest.fail.Exception:
        pytest.fail(f"expected {expected} tickers ({why}); the operator runs {seen[0]}")


def churn(cluster: Cluster, cycles: int, start: int) -> None:
    """Create and delete jobs: every other one named `again`, the rest each a new name. Half
    are deleted once the operator wrote their status (their ticker surely started), the others
    at once (kopf may then see the creation and the deletion in one batch)."""
    for i in range(start, start + cycles):
        name = "again" if i % 2 == 0 else f"churn-{i}"
        cluster.create_job(name, suspend=True)
        if i % 4 < 2:
            wait_for(f"the operator's status on {name}", has_phase(cluster, name))
        cluster.kube.delete(cluster.job_path(name))


def has_phase(cluster: Cluster, name: str) -> Callable[[], object]:
    return lambda: cluster.status(name).get("phase")


def test_churn_leaves_one_ticker_per_live_job_and_flat_memory(
        cluster: Cluster, operator_factory: Callable[..., Operator]) -> None:
    port = free_port()
    op = operator_factory("--standalone", "--metrics-port", str(port))
    op.start()
    for name in KEEP:
        cluster.create_job(name, suspend=True)
    await_tickers(port, len(KEEP), "the jobs that stay")

    churn(cluster, WARMUP, 0)
    await_tickers(port, len(KEEP), f"after {WARMUP} create/delete cycles")
    baseline = rss_bytes(op)

    churn(cluster, CYCLES, WARMUP)
    await_tickers(port, len(KEEP), f"after {WARMUP + CYCLES} create/delete cycles")
    grown = rss_bytes(op) - baseline

    # The name deleted and created again and again, once more: exactly one ticker, its own. Then a
    # job created after everything above, seen through by the operator: the events of every
    # earlier job reached kopf before its own, so a late ticker of a deleted job would have
    # started by now and the count would stay above the live jobs.
    cluster.create_job("again", suspend=True)
    await_tickers(port, len(KEEP) + 1, "the re-created job's")
    cluster.create_job("last", suspend=True)
    wait_for("the last job's status", lambda: cluster.status("last").get("phase"))
    await_tickers(port, len(KEEP) + 2, "the live jobs' and no more")
    wait_for("only the live jobs by phase", lambda: (scrape(port) or {}).get(
        'elastrain_operator_jobs{phase="Suspended"}') == len(KEEP) + 2)
    assert grown < MAX_GROWTH_BYTES, (
        f"RSS grew {grown / 2**20:.1f} MiB over {CYCLES} create/delete cycles "
        f"(baseline {baseline / 2**20:.1f} MiB)")
