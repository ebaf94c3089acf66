"""The trainer's Prometheus metrics and the /progress document, behind record_* functions.

Served by local rank 0 on ELASTRAIN_METRICS_PORT: /metrics (Prometheus text) and
/progress (JSON the operator polls to fill TrainingJob status, so it needs neither
object-store credentials nor RBAC on the workers).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry()
_P = "elastrain_trainer_"
_STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_CKPT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

STEPS = Counter(_P + "steps", "Optimizer steps completed (skipped steps included)",
                registry=REGISTRY)
STEP_SECONDS = Histogram(_P + "step_duration_seconds", "Wall time of one training step",
                         buckets=_STEP_BUCKETS, registry=REGISTRY)
TOKENS = Counter(_P + "tokens", "Tokens trained on (global)", registry=REGISTRY)
SAVE_SECONDS = Histogram(_P + "checkpoint_save_duration_seconds",
                         "Checkpoint save time, start to commit", buckets=_CKPT_BUCKETS,
                         registry=REGISTRY)
LOAD_SECONDS = Histogram(_P + "checkpoint_load_duration_seconds", "Checkpoint load time",
                         buckets=_CKPT_BUCKETS, registry=REGISTRY)
WRITTEN_BYTES = Counter(_P + "checkpoint_written_bytes", "Bytes of committed checkpoints",
                        registry=REGISTRY)
WORLD_SIZE = Gauge(_P + "world_size", "Ranks in the current world", registry=REGISTRY)
RESTARTS = Counter(_P + "restarts", "Worker-group restarts seen by torchrun on this node",
                   registry=REGISTRY)
GOODPUT = Gauge(_P + "goodput_ratio",
                "Share of this process's wall time spent in training steps", registry=REGISTRY)
LOSS = Gauge(_P + "loss", "Loss of the last step (mean over ranks)", registry=REGISTRY)
VALIDATION_LOSS = Gauge(_P + "validation_loss",
                        "Mean loss on the validation split at its latest evaluation",
                        registry=REGISTRY)
VALIDATION_STEP = Gauge(_P + "validation_step", "The step of the latest validation loss",
                        registry=REGISTRY)
# A timestamp rather than an age: Prometheus computes the age (time() - ...) at query time.
LAST_CHECKPOINT_TIME = Gauge(_P + "last_checkpoint_timestamp_seconds",
                             "Unix time of the newest committed checkpoint", registry=REGISTRY)
# kind is one of checkpoint.problems.KINDS (bounded).
CHECKPOINT_FAILURES = Counter(_P + "checkpoint_failures",
                              "Checkpoint saves and start-up checks of the location that failed",
                              ["kind"], registry=REGISTRY)
CONSECUTIVE_FAILURES = Gauge(_P + "checkpoint_consecutive_failures",
                             "Checkpoint saves (or start-up checks) that failed since the last "
                             "one that succeeded", registry=REGISTRY)
FALLBACKS = Counter(_P + "checkpoint_fallbacks",
                    "Resumes that skipped a committed checkpoint proven damaged",
                    registry=REGISTRY)
STEPS_LOST = Counter(_P + "steps_lost",
                     "Steps between a skipped damaged checkpoint and the one resumed from",
                     registry=REGISTRY)
PEAK_MEMORY = Gauge(_P + "peak_memory_bytes",
                    "This process's peak memory so far: max allocated on its CUDA device, or its "
                    "peak resident set (VmHWM) on a CPU run", registry=REGISTRY)


@dataclass
class _Progress:
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    world_size: int = 0
    last_checkpoint: dict[str, Any] | None = None
    resumed_from_step: int | None = None  # None: this start began from scratch
    training_since: str | None = None  # RFC3339; when this start's first step completed
    # The operator's hang watchdog: no step since max(startedAt, lastStepTime) for too long.
    started_at: str | None = None  # RFC3339; when this process (worker group start) began
    last_step_time: str | None = None  # RFC3339; when the latest step completed
    # Checkpoint health (None: nothing saved or checked yet in this process).
    checkpoint_failures: int | None = None  # consecutive: reset by a commit or a passed check
    checkpoint_error: str | None = None  # the latest failure's diagnosis (kept after recovery)
    checkpoint_failed_at: str | None = None  # RFC3339
    # Memory per rank (None: not measured yet). Not read by the operator; for `estimate` checks.
    memory_peak_bytes: int | None = None
    memory_measure: str | None = None  # "cuda_allocated" or "host_rss"
    memory_estimate_bytes: int | None = None  # what estimate.estimate() predicted for this rank
    # This start's resume skipped a damaged checkpoint (None: it did not); the operator's
    # CheckpointFallback condition and Warning event.
    checkpoint_fallback: dict[str, Any] | None = None
    # The latest validation loss and its step (None: no validation split, or not evaluated yet).
    validation_loss: float | None = None
    validation_step: int | None = None
    # How this worker recovers from a peer's loss: "Restart" (a new process per change) or
    # "InProcess" (docs/recovery.md); the generation of the process group (InProcess only).
    recovery_mode: str = "Restart"
    generation: int | None = None
    # InProcess with spares: "member" (in the world) or "spare" (waiting beyond it); None
    # before a plan named this node, and in Restart mode (left out of the document then).
    role: str | None = None
    # The desired world (spec.replicas) from the operator's `POST /control` (apply_control).
    desired_replicas: int | None = None
    # ... and the pods it is moving off nodes with a notice (inprocess.hold).
    moving: frozenset[str] = frozenset()
    # ... and the pods on nodes it knows lost (NotReady, unreachable) that the world must
    # plan out before it replaces them (their processes may still run: a kubelet that stopped).
    lost: frozenset[str] = frozenset()
    # InProcess: pods the world planned out without notice and not back since (Plan.lost),
    # each with when (this process's monotonic clock) this trainer first saw it so.
    planned_out: dict[str, float] = field(default_factory=dict)
    # InProcess: the pods of the current plan, in the world and waiting as its spares (the
    # operator moves a worker off a node with a notice once its replacement is among them).
    members: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()
    # InProcess: seconds since this node's heartbeat last heard the job's store (None: no
    # heartbeat yet); the operator replaces a store no trainer hears (watch_store).
    store_unanswered: Callable[[], float | None] | None = None


_progress = _Progress()
_lock = threading.Lock()
_read = threading.Condition(_lock)  # notified whenever a /progress document was delivered
# /progress documents built, and the newest of them written out in full: a trainer about to exit
# waits for a document built after its last record to be delivered, not merely built (a process
# that exits while its server thread is still writing the reply leaves the operator nothing).
_built = 0
_delivered = 0


def record_start(total_steps: int, world_size: int, restarts: int) -> None:
    """A (re)start of this worker group: torchrun runs each one in a fresh process."""
    with _lock:
        _progress.total_steps, _progress.world_size = total_steps, world_size
        _progress.resumed_from_step = _progress.training_since = None
        _progress.checkpoint_fallback = None
        _progress.started_at = _rfc3339(datetime.now(UTC))
    WORLD_SIZE.set(world_size)
    if restarts:
        RESTARTS.inc(restarts)


def record_step(step: int, loss: float, duration_s: float, tokens: int) -> None:
    STEPS.inc()
    STEP_SECONDS.observe(duration_s)
    TOKENS.inc(tokens)
    LOSS.set(loss)
    with _lock:
        _progress.step, _progress.loss = step, loss
        _progress.last_step_time = _rfc3339(datetime.now(UTC))
        if _progress.training_since is None:
            # The operator measures a loss's recovery up to here: training really runs again.
            _progress.training_since = _progress.last_step_time


def record_validation(step: int, loss: float) -> None:
    """The validation split's mean loss (over every rank's share) after `step`."""
    VALIDATION_LOSS.set(loss)
    VALIDATION_STEP.set(step)
    with _lock:
        _progress.validation_loss, _progress.validation_step = loss, step


def record_memory_estimate(total_bytes: int) -> None:
    """What the memory estimate predicts per rank for this run's config and world size."""
    with _lock:
        _progress.memory_estimate_bytes = total_bytes


def record_peak_memory(peak_bytes: int, measure: str) -> None:
    """The peak so far (`measure`: "cuda_allocated" or "host_rss"); see estimate.measure_peak."""
    PEAK_MEMORY.set(peak_bytes)
    with _lock:
        _progress.memory_peak_bytes, _progress.memory_measure = peak_bytes, measure


def record_generation(generation: int, world_size: int, step: int, *, regrouped: bool) -> None:
    """In-process recovery entered a generation of the process group. After a regroup
    (`regrouped`: not the job's start generation) training resumes in the same process at
    `step`: trainingSince is cleared so that the first step completed from here sets it (the
    operator measures a loss's recovery up to it), and resumedFromStep is `step`."""
    WORLD_SIZE.set(world_size)
    with _lock:
        _progress.recovery_mode, _progress.generation = "InProcess", generation
        _progress.world_size = world_size
        if regrouped:
            _progress.step = _progress.resumed_from_step = step
            _progress.training_since = None


def record_planned_out(pods: Iterable[str]) -> None:
    """The current plan's lost pods; /progress tells the operator each one's age (seconds since
    this trainer first saw it planned out: no clock of two machines is compared)."""
    now = time.monotonic()
    with _lock:
        _progress.planned_out = {p: _progress.planned_out.get(p, now) for p in pods}


# A planned-out pod that announced its rejoin (alive: restarting in place) is reported this
# much younger: the operator's grace (policy.replace) then starts after the announcement plus
# this, time for a new process to import torch and join on a loaded node.
REJOIN_ALLOWANCE_S = 30.0


def record_rejoining(pod: str) -> None:
    """A lost pod announced its rejoin: its planned-out age restarts, minus REJOIN_ALLOWANCE_S
    (a pod whose restart never joins is still replaced, that much later)."""
    with _lock:
        if pod in _progress.planned_out:
            _progress.planned_out[pod] = time.monotonic() + REJOIN_ALLOWANCE_S


def record_world_pods(members: Iterable[str], spares: Iterable[str]) -> None:
    """The current plan's pods: its members and its spares."""
    with _lock:
        _progress.members, _progress.spares = tuple(members), tuple(spares)


def watch_store(unanswered_s: Callable[[], float | None]) -> None:
    """Where /progress reads how long this node's heartbeat has not heard the store."""
    with _lock:
        _progress.store_unanswered = unanswered_s


def record_role(role: str) -> None:
    with _lock:
        _progress.role = role


def desired_replicas() -> int | None:
    """What the operator's latest `POST /control` said (None: not told yet)."""
    with _lock:
        return _progress.desired_replicas


def moving_pods() -> frozenset[str]:
    """The pods the operator's latest `POST /control` said it is moving."""
    with _lock:
        return _progress.moving


def lost_pods() -> frozenset[str]:
    """The pods the operator's latest `POST /control` said are on a lost node."""
    with _lock:
        return _progress.lost


# The operator's control channel (issue 34 item 6): only a request that bears the job's control
# token (a file from the job's Secret, read per request so a rotated Secret takes effect) may
# change what the trainer does; /progress and /metrics are read-only for everyone.
CONTROL_TOKEN_FILE_ENV = "ELASTRAIN_CONTROL_TOKEN_FILE"
MAX_CONTROL_BODY = 65536
MAX_MOVING = 200  # per list ("moving", "lost"); a body past MAX_CONTROL_BODY is refused whole


class ControlRefused(Exception):
    """(status, reason) of a control request that changes nothing."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _control_token() -> str | None:
    path = os.environ.get(CONTROL_TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError:
        return None
    return token or None


def apply_control(authorization: str | None, body: bytes) -> None:
    """A control request: `Authorization: Bearer <token>`, a JSON object `{"replicas": N}`
    and optionally `"moving": [pod, ...]` (the pods the operator moves off a node with a
    notice) and `"lost": [pod, ...]` (pods on a node it knows lost). ControlRefused (and
    nothing changed) unless the token is the job's and the message well formed."""
    import hmac

    token = _control_token()
    if token is None:
        raise ControlRefused(403, "this trainer has no control token: control is off")
    scheme, _, offered = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(offered.strip().encode(),
                                                             token.encode()):
        raise ControlRefused(401, "not the job's control token")
    try:
        message = json.loads(body)
    except ValueError as e:
        raise ControlRefused(400, f"the body is not JSON: {e}") from None
    replicas = message.get("replicas") if isinstance(message, dict) else None
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ControlRefused(400, '"replicas" must be a whole number of at least 1')
    moving, lost = message.get("moving", []), message.get("lost", [])
    for key, pods in (("moving", moving), ("lost", lost)):
        if not isinstance(pods, list) or len(pods) > MAX_MOVING or not all(
                isinstance(p, str) and 0 < len(p) <= 253 for p in pods):
            raise ControlRefused(400, f'"{key}" must be a list of at most {MAX_MOVING} pod '
                                      'names')
    with _lock:
        _progress.desired_replicas = replicas
        _progress.moving = frozenset(moving)
        _progress.lost = frozenset(lost)


def record_resumed(step: int) -> None:
    with _lock:
        _progress.step = _progress.resumed_from_step = step


def record_checkpoint_fallback(*, skipped_step: int, skipped_uri: str, reason: str,
                               loaded_step: int | None, loaded_uri: str | None, steps_lost: int,
                               quarantined: bool) -> None:
    """The resume skipped a committed checkpoint proven damaged (the newest such)."""
    STEPS_LOST.inc(steps_lost)
    FALLBACKS.inc()
    with _lock:
        _progress.checkpoint_fallback = {
            "skippedStep": skipped_step, "skippedUri": skipped_uri, "reason": reason[:600],
            "loadedStep": loaded_step, "loadedUri": loaded_uri, "stepsLost": steps_lost,
            "quarantined": quarantined, "time": _rfc3339(datetime.now(UTC))}


def record_goodput(ratio: float) -> None:
    GOODPUT.set(ratio)


def record_checkpoint_save(duration_s: float) -> None:
    SAVE_SECONDS.observe(duration_s)


def record_checkpoint_load(duration_s: float) -> None:
    LOAD_SECONDS.observe(duration_s)


def record_checkpoint_written_bytes(n: int) -> None:
    WRITTEN_BYTES.inc(n)


def record_checkpoint_failed(kind: str, error: str) -> None:
    """A save, or the start-up check of the checkpoint location, failed."""
    CHECKPOINT_FAILURES.labels(kind=kind).inc()
    with _lock:
        _progress.checkpoint_failures = (_progress.checkpoint_failures or 0) + 1
        _progress.checkpoint_error = error
        _progress.checkpoint_failed_at = _rfc3339(datetime.now(UTC))
        CONSECUTIVE_FAILURES.set(_progress.checkpoint_failures)


def record_checkpoint_healthy() -> None:
    """A save committed, or the start-up check passed: the failure streak is over."""
    with _lock:
        _progress.checkpoint_failures = 0
    CONSECUTIVE_FAILURES.set(0)


def progress_reads() -> int:
    """How many /progress documents were built so far (what wait_for_progress_read is after)."""
    with _lock:
        return _built


def wait_for_progress_read(after: int, timeout: float) -> bool:
    """Block until a /progress document built after progress_reads() returned `after` was
    written to its reader in full."""
    with _read:
        return _read.wait_for(lambda: _delivered > after, timeout)


def record_committed(step: int, uri: str, time_rfc3339: str) -> None:
    with _lock:
        _progress.last_checkpoint = {"step": step, "uri": uri, "time": time_rfc3339}
    committed = datetime.fromisoformat(time_rfc3339.replace("Z", "+00:00"))
    LAST_CHECKPOINT_TIME.set(committed.timestamp())


def progress_document() -> dict[str, Any]:
    """The /progress JSON (field names are the operator's contract)."""
    with _lock:
        return _document()


def _served_progress_document() -> tuple[int, dict[str, Any]]:
    """(its sequence number, the document) for one /progress request."""
    global _built
    with _lock:
        _built += 1
        return _built, _document()


def _progress_delivered(seq: int) -> None:
    global _delivered
    with _read:
        _delivered = max(_delivered, seq)
        _read.notify_all()


def _document() -> dict[str, Any]:
    """The /progress document; the caller holds _lock."""
    loss = _progress.loss
    health = None
    if _progress.checkpoint_failures is not None:
        health = {"consecutiveFailures": _progress.checkpoint_failures,
                  "lastError": _progress.checkpoint_error,
                  "lastFailureTime": _progress.checkpoint_failed_at}
    return {"step": _progress.step, "totalSteps": _progress.total_steps,
            "loss": loss if loss is None or loss == loss else None,  # NaN is not JSON
            "worldSize": _progress.world_size,
            "lastCheckpoint": _progress.last_checkpoint,
            "resumedFromStep": _progress.resumed_from_step,
            "trainingSince": _progress.training_since,
            "startedAt": _progress.started_at,
            "lastStepTime": _progress.last_step_time,
            "checkpointHealth": health,
            "checkpointFallback": _progress.checkpoint_fallback,
            "validation": _validation(),
            "memory": _memory(),
            "recoveryMode": _progress.recovery_mode,
            "generation": _progress.generation,
            **({"role": _progress.role} if _progress.role is not None else {}),
            **({"plannedOut": {p: max(0.0, round(time.monotonic() - t, 1))
                               for p, t in _progress.planned_out.items()}}
               if _progress.planned_out else {}),
            **({"members": list(_progress.members), "spares": list(_progress.spares)}
               if _progress.members else {}),
            **({"storeUnansweredSeconds": round(unanswered, 1)}
               if (unanswered := _store_unanswered()) is not None else {})}


def _store_unanswered() -> float | None:
    """Takes the heartbeat's lock inside _lock: the heartbeat never calls in here holding it."""
    return _progress.store_unanswered() if _progress.store_unanswered is not None else None


def _validation() -> dict[str, Any] | None:
    """The "validation" field of /progress ({"step", "loss"}); the caller holds _lock."""
    loss = _progress.validation_loss
    if _progress.validation_step is None or loss is None or loss != loss:  # NaN is not JSON
        return None
    return {"step": _progress.validation_step, "loss": loss}


def _memory() -> dict[str, Any] | None:
    """The "memory" field of /progress; the caller holds _lock."""
    if _progress.memory_peak_bytes is None and _progress.memory_estimate_bytes is None:
        return None
    return {"peakBytes": _progress.memory_peak_bytes, "measure": _progress.memory_measure,
            "estimateBytes": _progress.memory_estimate_bytes}


# Kubernetes creates this file in every container and copies what a process wrote into it to the
# container's terminated state when it exits: the operator reads the final progress there, since
# a finished trainer is gone before the next /progress poll (seen on a real node: the job ended
# Succeeded with status.lastCheckpoint one checkpoint behind the committed final one).
TERMINATION_LOG = Path(os.environ.get("ELASTRAIN_TERMINATION_LOG", "/dev/termination-log"))


def write_final_progress(path: Path = TERMINATION_LOG) -> bool:
    """The /progress document into the termination-message file, when the file exists (only in a
    Kubernetes container; never created elsewhere). Written on success only: on a failure the
    log's tail must stay the message (terminationMessagePolicy FallbackToLogsOnError)."""
    if not path.exists():
        return False
    try:
        path.write_text(json.dumps(progress_document()))
    except OSError:
        return False
    return True


def _rfc3339(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        path = self.path.partition("?")[0]  # a query changes nothing (see apply_control)
        seq = 0
        if path == "/metrics":
            body, ctype = generate_latest(REGISTRY), "text/plain; version=0.0.4"
        elif path == "/progress":
            seq, document = _served_progress_document()
            body, ctype = json.dumps(document).encode(), "application/json"
        else:
            self.send_error(404)
            return
        self._reply(body, ctype, seq)

    def do_POST(self) -> None:
        """POST /control: the operator's; answers the /progress document, so one request
        per poll both tells and reads."""
        if self.path.partition("?")[0] != "/control":
            self.send_error(404)
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_CONTROL_BODY:
            self.send_error(413 if length > MAX_CONTROL_BODY else 411)
            return
        try:
            apply_control(self.headers.get("Authorization"), self.rfile.read(length))
        except ControlRefused as refused:
            self.send_error(refused.status, str(refused))
            return
        seq, document = _served_progress_document()
        self._reply(json.dumps(document).encode(), "application/json", seq)

    def _reply(self, body: bytes, ctype: str, seq: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if seq:
            _progress_delivered(seq)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would drown the step log


def serve(port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Start serving /metrics and /progress in a daemon thread; OSError if the port is taken."""
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
