"""Poll the trainers' `GET /progress` (see policy.progress for the contract).

In-process jobs are asked `GET /progress?replicas=<desired workers>`: how their trainers learn
the desired world after `kubectl scale` (and so who waits as a spare). Restart-mode jobs are asked
the plain path, as before: a trainer image older than the query answers any other path 404.

Short timeouts and every failure ignored: progress is nice to have, never a reason for a
reconcile to fail or stall. At most MAX_POLLED Ready workers are asked, in parallel.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from elastrain_operator.model.spec import TrainingJobSpec
from elastrain_operator.policy.failures import WorkerPod, answers_progress
from elastrain_operator.policy.progress import ProgressReport, parse_progress

TIMEOUT_SECONDS = 1.0
MAX_POLLED = 8


def progress_url(ip: str, port: int, replicas: int | None) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    query = "" if replicas is None else f"?replicas={replicas}"
    return f"http://{host}:{port}/progress{query}"


def control_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/control"


def fetch_progress(ip: str, port: int, replicas: int | None = None,
                   timeout: float = TIMEOUT_SECONDS, token: str | None = None,
                   ) -> ProgressReport | None:
    """The trainer's progress; with `token` and `replicas`, told on the control channel
    (POST /control, which answers the same document) instead of the query."""
    request: str | urllib.request.Request = progress_url(ip, port, replicas)
    if token is not None and replicas is not None:
        request = urllib.request.Request(
            control_url(ip, port), method="POST", data=json.dumps({"replicas": replicas}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as rsp:
            return parse_progress(json.loads(rsp.read(65536)))
    except (OSError, ValueError):
        return None


def poll_progress(workers: Sequence[WorkerPod], port: int,
                  replicas: int | None = None) -> tuple[ProgressReport, ...]:
    """`replicas`: the desired workers to tell every trainer (None: ask the plain path)."""
    targets = [w.pod_ip for w in workers if answers_progress(w)][:MAX_POLLED]
    if not targets or not port:
        return ()
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        reports = list(pool.map(lambda ip: fetch_progress(ip, port, replicas), targets))
    return tuple(r for r in reports if r is not None)


def told_replicas(spec: TrainingJobSpec) -> int | None:
    """What a poll of this job tells its trainers: the desired workers, in-process only."""
    return spec.desired_workers if spec.in_process else None
