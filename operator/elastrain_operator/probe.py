"""Poll the trainers' `GET /progress` (see policy.progress for the contract); tell in-process
trainers the desired world on the control channel.

In-process jobs are asked `POST /control` with the job's token (control.py) and `{"replicas":
<desired workers>, "moving": [pods], "lost": [pods]}`: how their trainers learn the desired
world after `kubectl scale` (and so who waits as a spare), which pods are moving off a node with
a notice (policy.notices: such a pod's trainer, SIGTERMed before its replacement joined, trains
on until a node can take its place), and which are on a node the operator knows lost (the world
asks them to leave: policy.replace); the answer is the same progress document. A trainer that
refuses the token (its job's Secret holds another key's, or it has none: pods from before the
channel) is read with the plain GET and a warning says why it cannot be steered. Restart-mode
jobs are asked the plain path.

Short timeouts and every other failure ignored: progress is nice to have, never a reason for a
reconcile to fail or stall. At most MAX_POLLED Ready workers are asked, in parallel.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from elastrain_operator.model.spec import TrainingJobSpec
from elastrain_operator.model.status import TrainingJobStatus
from elastrain_operator.policy.failures import WorkerPod, answers_progress, aware_time
from elastrain_operator.policy.progress import ProgressReport, parse_progress
from elastrain_operator.policy.stale import lost_under

log = logging.getLogger(__name__)
TIMEOUT_SECONDS = 1.0
MAX_POLLED = 8
MAX_MOVING = 200  # what a trainer accepts (its MAX_MOVING)


def _base(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def fetch_progress(ip: str, port: int, replicas: int | None = None,
                   timeout: float = TIMEOUT_SECONDS, token: str | None = None,
                   moving: Sequence[str] = (), lost: Sequence[str] = ()
                   ) -> ProgressReport | None:
    """The trainer's progress; with `token` and `replicas`, the desired world (and the pods
    `moving`, and those `lost`) told on the control channel first (which answers the same
    document)."""
    if token is not None and replicas is not None:
        request = urllib.request.Request(
            f"{_base(ip, port)}/control", method="POST",
            data=json.dumps({"replicas": replicas, "moving": list(moving[:MAX_MOVING]),
                             "lost": list(lost[:MAX_MOVING])}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as rsp:
                return parse_progress(json.loads(rsp.read(65536)))
        except urllib.error.HTTPError as err:
            if err.code not in (401, 403, 404, 501):
                return None
            _refused(ip, port, err.code)
        except (OSError, ValueError):
            return None
    try:
        with urllib.request.urlopen(f"{_base(ip, port)}/progress", timeout=timeout) as rsp:
            return parse_progress(json.loads(rsp.read(65536)))
    except (OSError, ValueError):
        return None


_warned: set[tuple[str, int, int]] = set()  # (ip, port, status): each said once


def _refused(ip: str, port: int, code: int) -> None:
    if (ip, port, code) in _warned:
        return
    if len(_warned) > 1000:  # pod IPs come and go: forget, and warn again, rather than grow
        _warned.clear()
    _warned.add((ip, port, code))
    why = {401: "it holds another control token (its job's Secret was made under another "
                "operator key: set ELASTRAIN_CONTROL_KEY, the chart does; deleting the job's "
                "<job>-control Secret lets its next new pod bring the current one)",
           403: "it has no control token (a pod from before the control channel)",
           404: "it serves no control channel (an older trainer image)",
           501: "it serves no control channel (an older trainer image)"}[code]
    log.warning("the trainer at %s refused the desired world (%d): %s; its progress is read, "
                "but it keeps the world it knows until its pod is replaced", ip, code, why)


def poll_progress(workers: Sequence[WorkerPod], port: int, replicas: int | None = None,
                  token: str | None = None, moving: Sequence[str] = (),
                  lost: Sequence[str] = ()) -> tuple[ProgressReport, ...]:
    """`replicas`: the desired workers to tell every trainer, with the job's control `token`
    (either None: ask the plain path); `moving`: the pods being moved (told_moving); `lost`:
    the pods on lost nodes (told_lost)."""
    targets = [w.pod_ip for w in workers if answers_progress(w)][:MAX_POLLED]
    if not targets or not port:
        return ()
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        reports = list(pool.map(
            lambda ip: fetch_progress(ip, port, replicas, token=token, moving=moving,
                                      lost=lost),
            targets))
    return tuple(r for r in reports if r is not None)


def told_replicas(spec: TrainingJobSpec,
                  status: TrainingJobStatus | None = None) -> int | None:
    """What a poll of this job tells its trainers: the desired workers, in-process only; no
    more than Kueue admitted (status.queue, policy.kueue)."""
    if not spec.in_process:
        return None
    queue = status.queue if status is not None else None
    if queue is not None and queue.state == "Admitted" and queue.admitted_workers:
        return max(min(spec.desired_workers, queue.admitted_workers), 1)
    return spec.desired_workers


def told_moving(status: TrainingJobStatus) -> tuple[str, ...]:
    """The pods a poll tells the trainers are moving: each slot's old pod while it moves."""
    return tuple(s.moving_from for s in status.slots if s.moving_from)


def told_lost(workers: Sequence[WorkerPod], lost_nodes: Mapping[str, str],
              lost_since: Mapping[str, datetime] | None = None) -> tuple[str, ...]:
    """The pods a poll tells the trainers are on a lost node (policy.replace: the world asks
    them to leave before the operator replaces them); not one created since its node's loss
    began (policy.stale.lost_under)."""
    return tuple(w.name for w in workers
                 if lost_under(aware_time(w.created), w.node, lost_nodes, lost_since or {}))
