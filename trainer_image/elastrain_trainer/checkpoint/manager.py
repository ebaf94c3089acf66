"""CheckpointManager: save (sync or async), atomic commit, retention, resume with fallback.

Usable from any training loop that has a process group:
    manager = CheckpointManager(open_storage(uri), keep=3, async_save=True)
    manager.load(state)                                # newest committed checkpoint, if any
    manager.save(SaveRequest(step, state, sidecar))    # every N steps
    manager.close()                                    # waits for the upload in flight
`state` is a DCP state dict (e.g. {"model": ..., "optim": ...} from get_state_dict).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from elastrain_trainer import metrics
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.dcp_io import CheckpointReader, CheckpointWriter
from elastrain_trainer.checkpoint.diagnose import diagnose
from elastrain_trainer.checkpoint.storage import CheckpointStorage, join, open_storage
from elastrain_trainer.events import emit


@dataclass
class SaveRequest:
    step: int
    state: dict[str, Any]
    sidecar: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Committed:
    step: int
    uri: str
    time: str  # RFC 3339


@dataclass(frozen=True)
class LoadResult:
    step: int
    uri: str
    sidecar: dict[str, Any]


@dataclass
class _Pending:
    step: int
    future: Future[Any]
    started: float
    blocked_s: float


class CheckpointManager:
    """One per process; every rank calls save/load collectively, in the same order."""

    def __init__(self, storage: CheckpointStorage, *, keep: int = 3, async_save: bool = True,
                 process_group: dist.ProcessGroup | None = None, endpoint: str = "") -> None:
        self.storage = storage
        self.keep = keep
        self.async_save = async_save
        self.pg = process_group
        self.endpoint = endpoint
        self.last_committed: Committed | None = None
        self.failed_saves = 0
        self.last_error: BaseException | None = None
        self._pending: _Pending | None = None
        self._loaded_step: int | None = None
        # Async saves copy the state into host buffers kept from one save to the next: the
        # copy then lands in memory already mapped (DCP's default stager is made and dropped
        # per save, so every save paid for fresh pages). Costs one copy of the state in RAM.
        self._stager: DefaultStager | None = None

    # -- save -------------------------------------------------------------------------
    def save(self, req: SaveRequest, *, blocking: bool = False) -> float:
        """Start a save of `req`; returns the seconds the caller was blocked.

        Async: blocked only while the state is staged to host memory. A failed save is
        logged and counted, never raised: training goes on and the next save retries.
        """
        t0 = time.monotonic()
        self.wait()  # one save in flight at a time, and saves commit in step order
        if req.step in (self._loaded_step, self.last_committed and self.last_committed.step):
            return time.monotonic() - t0  # this exact state is already committed
        writer = CheckpointWriter(self.storage, mf.step_dir(req.step),
                                  lambda files, world: self._commit(req, files, world))
        try:
            if self.async_save and not blocking:
                if self._stager is None:
                    self._stager = DefaultStager(StagingOptions(False, False, False, False))
                future = dcp_async_save(req.state, storage_writer=writer, process_group=self.pg,
                                        async_stager=self._stager)
                assert isinstance(future, Future)
                blocked = time.monotonic() - t0
                self._pending = _Pending(req.step, future, t0, blocked)
                return blocked
            dcp_save(req.state, storage_writer=writer, process_group=self.pg)
            self._finished(req.step, t0, time.monotonic() - t0, None)
        except (Exception, CheckpointException) as e:  # DCP raises a BaseException subclass
            self._finished(req.step, t0, time.monotonic() - t0, e)
        return time.monotonic() - t0

    def holds(self, step: int) -> bool:
        """True when the state of `step` is committed (saved by this manager, or loaded)."""
        return step in (self._loaded_step, self.last_committed and self.last_committed.step)

    def in_flight(self) -> bool:
        """True while a background save is still uploading (local view; agree before use)."""
        return self._pending is not None and not self._pending.future.done()

    def poll(self) -> None:
        """Reap a finished background save (logs and metrics); never blocks."""
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait(self) -> bool:
        """Block until the save in flight (if any) is done; True unless it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return True
        error: BaseException | None = None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:  # DCP raises a BaseException subclass
            error = e
        self._finished(pending.step, pending.started, pending.blocked_s, error)
        return error is None

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _finished(self, step: int, started: float, blocked_s: float,
                  error: BaseException | None) -> None:
        total = time.monotonic() - started
        if error is not None:
            self.failed_saves += 1
            self.last_error = error
            problem = diagnose(self.storage, _root_cause(error), action="save",
                               key=mf.step_dir(step))
            metrics.record_checkpoint_failed(problem.kind, problem.message)
            emit("checkpoint_failed", step=step, error=_short(error), kind=problem.kind,
                 note="training continues; the next checkpoint retries")
            return
        metrics.record_checkpoint_save(total)
        metrics.record_checkpoint_healthy()
        emit("checkpoint_saved", step=step, blocked_s=round(blocked_s, 4),
             total_s=round(total, 4), uri=join(self.storage.uri, mf.step_dir(step)))
        if self.last_committed is None or self.last_committed.step < step:
            self.last_committed = Committed(step, join(self.storage.uri, mf.step_dir(step)), _now())
            metrics.record_committed(step, self.last_committed.uri, self.last_committed.time)

    def _commit(self, req: SaveRequest, files: dict[str, mf.FileDigest], world: int) -> None:
        """Runs on the coordinator after every shard and .metadata exist: make it count."""
        key = mf.step_dir(req.step)
        manifest = mf.build_manifest(req.step, world, files)
        self.storage.write(join(key, mf.MANIFEST), manifest)
        self.storage.write(join(key, mf.SIDECAR), mf.sidecar_bytes(req.sidecar))
        self.storage.write(join(key, mf.COMMIT_MARKER), mf.build_commit_marker(req.step, manifest))
        self.storage.write(mf.LATEST, key.encode())
        metrics.record_checkpoint_written_bytes(sum(d.size for d in files.values()))
        self.apply_retention(writing=None)

    def apply_retention(self, writing: int | None) -> list[int]:
        """Delete what the retention plan allows; returns the deleted steps."""
        keys = self.storage.list()
        doomed = mf.plan_retention(mf.classify_keys(keys), self.keep, writing)
        prefixes = tuple(mf.step_dir(s) + "/" for s in doomed)
        self.storage.delete(mf.deletion_order([k for k in keys if k.startswith(prefixes)]))
        return doomed

    # -- load -------------------------------------------------------------------------
    def load(self, state: dict[str, Any], resume_from: str = "") -> LoadResult | None:
        """Load the newest committed checkpoint that verifies into `state` (in place).

        A corrupt or partial checkpoint is skipped with a log line and the previous
        committed one is tried. `resume_from` (a checkpoint directory URI) loads exactly
        that one and raises if it does not verify.
        """
        storage, candidates = self.storage, None
        if resume_from:
            root, _, name = resume_from.rstrip("/").rpartition("/")
            step = mf.parse_step_dir(name)
            if step is None:
                raise ValueError(f"--resume-from {resume_from!r} must end in step-NNNNNNNN")
            if root != self.storage.uri:
                storage = open_storage(root, self.endpoint)
            candidates = [step]
        if candidates is None:
            candidates = self._broadcast(
                lambda: mf.resume_candidates(mf.classify_keys(storage.list())))
        for step in candidates:
            t0 = time.monotonic()
            result = self._try_load(storage, step, state)
            if result is not None:
                metrics.record_checkpoint_load(time.monotonic() - t0)
                self._loaded_step = step
                self.last_committed = Committed(step, result.uri, _now())
                metrics.record_committed(step, result.uri, self.last_committed.time)
                return result
            if resume_from:
                raise ValueError(f"--resume-from {resume_from}: checkpoint does not verify")
        return None

    def _try_load(self, storage: CheckpointStorage, step: int,
                  state: dict[str, Any]) -> LoadResult | None:
        key = mf.step_dir(step)
        uri = join(storage.uri, key)
        checked = self._broadcast(lambda: _read_committed(storage, key))
        if isinstance(checked, str):
            emit("checkpoint_skipped", step=step, uri=uri, reason=checked,
                 note="falling back to the previous committed checkpoint")
            return None
        files, sidecar = checked
        try:
            dcp_load(state, storage_reader=CheckpointReader(storage, key, files),
                     process_group=self.pg)
        except (Exception, CheckpointException) as e:  # DCP raises a BaseException subclass
            emit("checkpoint_skipped", step=step, uri=uri, reason=_short(e),
                 note="falling back to the previous committed checkpoint")
            return None
        return LoadResult(step=step, uri=uri, sidecar=sidecar)

    def _broadcast(self, fn: Any) -> Any:
        """Compute on rank 0 and share, so every rank walks the same candidates."""
        if not dist.is_initialized():
            return fn()
        box = [fn() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]


def _read_committed(storage: CheckpointStorage,
                    key: str) -> tuple[dict[str, mf.FileDigest], dict[str, Any]] | str:
    """(manifest files, sidecar) of a committed checkpoint, or why it cannot be used."""
    try:
        marker = storage.read(join(key, mf.COMMIT_MARKER))
        manifest = storage.read(join(key, mf.MANIFEST))
        mf.verify_commit(marker, manifest)
        sidecar = json.loads(storage.read(join(key, mf.SIDECAR)))
        return mf.parse_manifest(manifest), sidecar
    except FileNotFoundError as e:
        return f"not committed or incomplete: {e}"
    except (mf.CorruptCheckpointError, ValueError, KeyError) as e:
        return f"corrupt: {e}"


def _root_cause(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's wrapper."""
    if isinstance(error, CheckpointException) and error.failures:
        return error.failures[min(error.failures)][0]
    return error


def _short(error: BaseException) -> str:
    """The root cause in one line (DCP wraps each rank's error with its traceback)."""
    if isinstance(error, CheckpointException):
        causes = {f"{type(exc).__name__}: {exc}" for exc, _tb in error.failures.values()}
        text = "; ".join(sorted(causes))
    else:
        text = f"{type(error).__name__}: {error}"
    return text if len(text) < 600 else text[:600] + "..."


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
