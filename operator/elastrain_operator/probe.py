"""Poll the trainers' `GET /progress` (see policy.progress for the contract).

Short timeouts and every failure ignored: progress is nice to have, never a reason for a
reconcile to fail or stall. At most MAX_POLLED Ready workers are asked, in parallel.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from elastrain_operator.policy.failures import WorkerPod, answers_progress
from elastrain_operator.policy.progress import ProgressReport, parse_progress

TIMEOUT_SECONDS = 1.0
MAX_POLLED = 8


def fetch_progress(ip: str, port: int, timeout: float = TIMEOUT_SECONDS) -> ProgressReport | None:
    host = f"[{ip}]" if ":" in ip else ip
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/progress", timeout=timeout) as rsp:
            return parse_progress(json.loads(rsp.read(65536)))
    except (OSError, ValueError):
        return None


def poll_progress(workers: Sequence[WorkerPod], port: int) -> tuple[ProgressReport, ...]:
    targets = [w.pod_ip for w in workers if answers_progress(w)][:MAX_POLLED]
    if not targets or not port:
        return ()
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        reports = list(pool.map(lambda ip: fetch_progress(ip, port), targets))
    return tuple(r for r in reports if r is not None)
