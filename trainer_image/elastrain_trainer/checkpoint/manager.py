"""CheckpointManager: save (sync or async), atomic commit, retention, resume with fallback.

Usable from any training loop that has a process group:
    manager = CheckpointManager(open_storage(uri), keep=3, async_save=True)
    manager.load(state)                                # newest committed checkpoint, if any
    manager.save(SaveRequest(step, state, sidecar))    # every N steps
    manager.close()                                    # waits for the upload in flight
`state` is a DCP state dict (e.g. {"model": ..., "optim": ...} from get_state_dict).

What it promises (catalog.py, read_faults.py):
- load() takes the newest commit (in commit order) and falls back to an older one only when the
  newer one is proven damaged; that one is quarantined (kept, never loaded again) and reported
  in `skipped`. A store that fails is retried for `wait_seconds`, then
  CheckpointUnavailableError stops the worker; no fault of the store makes it fall back.
- save() never writes into a directory that holds objects, so nothing committed is overwritten.
- retention keeps the newest `keep` commits in commit order and every damaged checkpoint;
  `latest` names the newest commit.
- with a `fence` (in-process mode's member, or a torchrun group's), a coordinator that the
  world has planned out commits nothing: no marker, no `latest`, no retention (catalog.py's
  fencing rule is the bucket's side of it).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from elastrain_trainer import fault_injection, metrics
from elastrain_trainer.checkpoint import catalog as cat
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint import read_faults as rf
from elastrain_trainer.checkpoint.backends import open_storage
from elastrain_trainer.checkpoint.dcp_io import (
    CheckpointReader,
    CheckpointWriter,
    root_cause,
    short_error,
)
from elastrain_trainer.checkpoint.diagnose import StorageProblem, diagnose
from elastrain_trainer.checkpoint.generations import Fence, check_not_outrun, record_generation
from elastrain_trainer.checkpoint.root import quarantine, read_committed, scan
from elastrain_trainer.checkpoint.storage import CheckpointStorage, join
from elastrain_trainer.events import emit

T = TypeVar("T")


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
class Skipped:
    """A committed checkpoint proven damaged at load, and skipped."""

    step: int
    uri: str
    reason: str
    quarantined: bool  # its QUARANTINED marker was written


@dataclass(frozen=True)
class LoadResult:
    step: int
    uri: str
    sidecar: dict[str, Any]


@dataclass
class _Pending:
    step: int
    key: str
    future: Future[Any]
    started: float
    blocked_s: float


class CheckpointManager:
    """One per process; every rank calls save/load collectively, in the same order.

    `run` names this run in each commit marker: load(run=...) resumes only that run's own
    commits (a run told to start over). `wait_seconds` bounds how long a failing store is
    retried at load. `fence`: see Fence (None: nothing to check, a run outside torchrun)."""

    def __init__(self, storage: CheckpointStorage, *, keep: int = 3, async_save: bool = True,
                 process_group: dist.ProcessGroup | None = None, endpoint: str = "",
                 run: str = "", wait_seconds: float = 600.0, fence: Fence | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.storage = storage
        self.keep = keep
        self.async_save = async_save
        self.pg = process_group
        self.endpoint = endpoint
        self.run = run
        self.wait_seconds = wait_seconds
        self.fence = fence
        self._fenced: dict[str, Exception] = {}  # save directory -> why its commit was refused
        self._clock, self._sleep = clock, sleep
        self.last_committed: Committed | None = None
        self.failed_saves = 0
        self.last_error: BaseException | None = None
        self.skipped: list[Skipped] = []
        self.catalog: cat.Catalog | None = None  # the same on every rank (rank 0's, shared)
        self._taken: set[str] = set()  # directories no save of this manager may write into
        self._next_seq = 1
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
        self.wait()  # one save in flight at a time, and saves commit in order
        if self.holds(req.step):
            return time.monotonic() - t0  # this exact state is already committed
        try:
            known = self._know_catalog()
        except (Exception, CheckpointException) as e:
            # Its broadcast (after each new generation), on a group whose peer was lost (in
            # process: the sever of a dark peer ends it): a failed save like any, so the lost
            # peer is met at the next collective, where in-process recovery catches it. Before,
            # it ended the survivors' processes (a fresh-clone `make test` at df08389).
            self._finished(req.step, "", t0, time.monotonic() - t0, e)
            return time.monotonic() - t0
        if isinstance(known, rf.Failed):
            self._finished(req.step, "", t0, time.monotonic() - t0,
                           rf.StoreFault(known.message, known.kind, not known.transient))
            return time.monotonic() - t0
        key = cat.choose_dir(req.step, self._taken)
        self._taken.add(key)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        writer = CheckpointWriter(self.storage, key,
                                  lambda files, world: self._commit(req, key, seq, files, world))
        try:
            if self.async_save and not blocking:
                if self._stager is None:
                    self._stager = DefaultStager(StagingOptions(False, False, False, False))
                future = dcp_async_save(req.state, storage_writer=writer, process_group=self.pg,
                                        async_stager=self._stager)
                assert isinstance(future, Future)
                blocked = time.monotonic() - t0
                self._pending = _Pending(req.step, key, future, t0, blocked)
                return blocked
            dcp_save(req.state, storage_writer=writer, process_group=self.pg)
            self._finished(req.step, key, t0, time.monotonic() - t0, None)
        except (Exception, CheckpointException) as e:  # DCP raises a BaseException subclass
            self._finished(req.step, key, t0, time.monotonic() - t0, e)
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
        self._finished(pending.step, pending.key, pending.started, pending.blocked_s, error)
        return error is None

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _finished(self, step: int, key: str, started: float, blocked_s: float,
                  error: BaseException | None) -> None:
        total = time.monotonic() - started
        fenced = self._fenced.pop(key, None)
        if error is not None and fenced is not None:
            # Not the store's fault, and nothing to retry: this node is out of the world. (The
            # error DCP raises is often the broadcast of the refusal to peers that are gone.)
            self.failed_saves += 1
            self.last_error = fenced
            emit("checkpoint_fenced", step=step, reason=str(fenced),
                 uri=join(self.storage.uri, key),
                 note="not committed: this node was planned out of the world")
            return
        if error is not None:
            self.failed_saves += 1
            self.last_error = error
            if key and self.catalog is not None:
                self.catalog = cat.with_uncommitted(self.catalog, key)
            problem = self._diagnose(root_cause(error), key or mf.step_dir(step))
            metrics.record_checkpoint_failed(problem.kind, problem.message)
            emit("checkpoint_failed", step=step, error=short_error(error), kind=problem.kind,
                 note="training continues; the next checkpoint retries")
            return
        uri = join(self.storage.uri, key)
        metrics.record_checkpoint_save(total)
        metrics.record_checkpoint_healthy()
        emit("checkpoint_saved", step=step, blocked_s=round(blocked_s, 4),
             total_s=round(total, 4), uri=uri)
        # The newest commit, whatever its step: after a fallback, older step numbers come again.
        self.last_committed = Committed(step, uri, _now())
        metrics.record_committed(step, uri, self.last_committed.time)

    def _diagnose(self, error: BaseException, key: str) -> StorageProblem:
        if isinstance(error, rf.StoreFault):
            return StorageProblem(error.kind, error.permanent, error.message)
        return diagnose(self.storage, error, action="save", key=key)

    def _commit(self, req: SaveRequest, key: str, seq: int, files: dict[str, mf.FileDigest],
                world: int) -> None:
        """Runs on the coordinator after every shard and .metadata exist: make it count."""
        fault_injection.before_commit()
        # Last, so a writer frozen until now learns here that it was planned out; a bucket
        # cannot compare-and-set, so a freeze between this check and the marker still gets
        # through: the catalog fences such a commit on read.
        try:
            store_epoch, gen = self.fence() if self.fence is not None else ("", 0)
            check_not_outrun(self.storage, self.catalog, self.run, store_epoch, gen)
        except Exception as e:
            self._fenced[key] = e
            raise
        manifest = mf.build_manifest(req.step, world, files)
        self.storage.write(join(key, mf.MANIFEST), manifest)
        self.storage.write(join(key, mf.SIDECAR), mf.sidecar_bytes(req.sidecar))
        self.storage.write(join(key, mf.COMMIT_MARKER),
                           mf.build_commit_marker(req.step, manifest, seq, self.run,
                                                  store_epoch, gen))
        self.storage.write(mf.LATEST, key.encode())
        metrics.record_checkpoint_written_bytes(sum(d.size for d in files.values()))
        if self.catalog is not None:
            names = [*files, mf.MANIFEST, mf.SIDECAR, mf.COMMIT_MARKER]
            commit = cat.Commit(key, req.step, seq, self.run, store_epoch, gen)
            self.catalog = cat.with_commit(self.catalog, commit, names)
        try:
            self.apply_retention()
        except Exception as e:  # committed all the same; the next commit deletes what is left
            emit("checkpoint_retention_failed", step=req.step, error=short_error(e))

    def mark_generation(self, lineage: str, gen: int) -> threading.Thread | None:
        """Tell the bucket this run's `lineage` entered generation `gen` (the world's
        coordinator, as it enters one; generations.record_generation)."""
        return record_generation(self.storage, self.catalog, self.run, lineage, gen,
                                 self._next_seq)

    def apply_retention(self) -> list[str]:
        """Delete what the retention plan allows; returns the deleted directories."""
        if self.catalog is None:
            return []
        doomed = cat.plan_retention(self.catalog, self.keep)
        for d in doomed:
            self.storage.delete(cat.deletion_order(self.storage.list(d + "/")))
        records = cat.superseded_generations(self.catalog)
        if records:
            self.storage.delete(records)
        self.catalog = cat.without(self.catalog, [*doomed, *records])
        return doomed

    def _know_catalog(self) -> rf.Failed | None:
        """Read the root's catalog once (a save must know which directories are taken); one
        attempt: a save that cannot list fails like any save and the next one tries again.
        (A writer cut off for a while knows only its own past: CheckpointWriter checks that
        the directory it chose holds nothing yet, off the training thread.)"""
        if self.catalog is not None:
            return None
        fault_injection.before_catalog(*((dist.get_rank(self.pg), dist.get_world_size(self.pg))
                                         if dist.is_initialized() else (0, 1)))
        outcome = self._broadcast(lambda: rf.attempt(lambda: scan(self.storage), self.storage,
                                                     action="list", key="", storage_call=True))
        if isinstance(outcome, rf.Ok):
            self._adopt(outcome.value)
            return None
        assert isinstance(outcome, rf.Failed)  # a listing proves no damage
        return outcome

    def _adopt(self, catalog: cat.Catalog) -> None:
        self.catalog = catalog
        self._taken |= catalog.taken()
        self._next_seq = max(self._next_seq, catalog.next_seq())

    # -- load -------------------------------------------------------------------------
    def load(self, state: dict[str, Any], resume_from: str = "", *,
             run: str | None = None) -> LoadResult | None:
        """Load the newest commit that is not proven damaged into `state` (in place); None
        when there is none. `run`: only that run's commits. `resume_from` (a checkpoint
        directory URI) loads exactly that one and raises ValueError if it is damaged.
        CheckpointUnavailableError when the store fails for longer than `wait_seconds`."""
        storage, name = self.storage, ""
        if resume_from:
            root, _, name = resume_from.rstrip("/").rpartition("/")
            if mf.parse_dir(name) is None:
                raise ValueError(f"--resume-from {resume_from!r} must end in step-NNNNNNNN")
            if root != self.storage.uri:
                storage = open_storage(root, self.endpoint)
        catalog = self._retrying(storage, "list", "", lambda: scan(storage), storage_call=True)
        assert isinstance(catalog, cat.Catalog)
        if storage is self.storage:
            self._adopt(catalog)
        if resume_from:
            candidates = [c for c in catalog.commits if c.dir == name]
            if not candidates:
                why = catalog.damaged.get(name, "no committed checkpoint there")
                raise ValueError(f"--resume-from {resume_from}: {why}")
        else:
            if run is None:
                self._report_damaged_markers(storage, catalog)
            candidates = cat.resume_candidates(catalog, run)
        for commit in candidates:
            t0 = time.monotonic()
            loaded = self._load_one(storage, commit, catalog, state)
            if isinstance(loaded, rf.Damaged):
                if resume_from:
                    raise ValueError(f"--resume-from {resume_from}: checkpoint does not verify: "
                                     f"{loaded.reason}")
                self._skip(storage, commit.dir, commit.step, loaded.reason)
                continue
            metrics.record_checkpoint_load(time.monotonic() - t0)
            self._loaded_step = commit.step
            self.last_committed = Committed(commit.step, loaded.uri, _now())
            metrics.record_committed(commit.step, loaded.uri, self.last_committed.time)
            self._repoint_latest(storage)
            return loaded
        self._repoint_latest(storage)
        return None

    def _load_one(self, storage: CheckpointStorage, commit: cat.Commit, catalog: cat.Catalog,
                  state: dict[str, Any]) -> LoadResult | rf.Damaged:
        key = commit.dir
        names = catalog.objects.get(key, frozenset())
        checked = self._retrying(storage, "read", key,
                                 lambda: read_committed(storage, key, names), storage_call=True)
        if isinstance(checked, rf.Damaged):
            return checked
        files, sidecar = checked
        # Rank 0 reads .metadata (verified) for everyone; its failure keeps its type here.
        metadata = self._retrying(storage, "read", key, storage_call=False,
                                  fn=lambda: CheckpointReader(storage, key, files).read_metadata())
        if isinstance(metadata, rf.Damaged):
            return metadata
        loaded = self._retrying(
            storage, "read", key, storage_call=False, everywhere=True,
            fn=lambda: dcp_load(state, process_group=self.pg,
                                storage_reader=CheckpointReader(storage, key, files, metadata)))
        if isinstance(loaded, rf.Damaged):
            return loaded
        return LoadResult(step=commit.step, uri=join(storage.uri, key), sidecar=sidecar)

    def _retrying(self, storage: CheckpointStorage, action: str, key: str,
                  fn: Callable[[], T], *, storage_call: bool,
                  everywhere: bool = False) -> T | rf.Damaged:
        """fn's value, or the proof of damage; a failure that proves nothing is retried with
        backoff (read_faults). `everywhere`: every rank runs fn (a collective); otherwise rank
        0 does and shares the outcome."""
        deadline = self._clock() + self.wait_seconds
        delay, tries = rf.FIRST_RETRY_SECONDS, 0
        while True:
            tries += 1

            def run() -> rf.Outcome:
                return rf.attempt(fn, storage, action=action, key=key, storage_call=storage_call)

            outcome = run() if everywhere else self._broadcast(run)
            if isinstance(outcome, rf.Ok):
                if tries > 1:
                    metrics.record_checkpoint_healthy()
                    self._emit("checkpoint_store_recovered", uri=join(storage.uri, key),
                               attempts=tries)
                return outcome.value  # type: ignore[no-any-return]
            if isinstance(outcome, rf.Damaged):
                return outcome
            assert isinstance(outcome, rf.Failed)
            retry = self._broadcast(partial(self._plan_retry, outcome, deadline, delay))
            metrics.record_checkpoint_failed(outcome.kind, outcome.message)
            self._emit("checkpoint_read_failed", uri=join(storage.uri, key), kind=outcome.kind,
                       transient=outcome.transient, error=outcome.message, attempt=tries,
                       retry_in_s=None if retry.seconds is None else round(retry.seconds, 2))
            if retry.seconds is None:
                raise rf.CheckpointUnavailableError(self._give_up(outcome, storage, key))
            self._sleep(retry.seconds)
            delay = rf.next_delay(delay)

    def _plan_retry(self, failed: rf.Failed, deadline: float, delay: float) -> rf.Retry:
        return rf.plan_retry(failed, now=self._clock(), deadline=deadline, delay=delay)

    def _give_up(self, failed: rf.Failed, storage: CheckpointStorage, key: str) -> str:
        # The reason first: the launcher's one-line crash reason keeps only the beginning.
        where = join(storage.uri, key) if key else storage.uri
        if failed.kind == rf.INCOMPATIBLE:
            return (f"checkpoint {where} does not fit this run, not resumed: {failed.message} "
                    "(start over with spec.checkpoint.resume: Never, or pick one with "
                    "--resume-from)")
        if not failed.transient:
            return f"checkpoint store refused, not resumed: {failed.message}"
        return (f"checkpoint store still failing after {self.wait_seconds:g} s, not resumed "
                f"(no older checkpoint is loaded instead): {failed.message}")

    def _report_damaged_markers(self, storage: CheckpointStorage, catalog: cat.Catalog) -> None:
        """Committed directories whose marker itself is damaged: skipped and told, once."""
        for d, why in sorted(catalog.damaged.items()):
            step = mf.parse_step_dir(d)
            if step is not None and why != "quarantined earlier":
                self._skip(storage, d, step, why)

    def _skip(self, storage: CheckpointStorage, d: str, step: int, reason: str) -> None:
        quarantined = self._broadcast(lambda: quarantine(storage, d, step, reason, _now()))
        uri = join(storage.uri, d)
        self.skipped.append(Skipped(step, uri, reason, bool(quarantined)))
        if self.catalog is not None and storage is self.storage:
            self.catalog = cat.with_damaged(self.catalog, d, reason)
        self._emit("checkpoint_skipped", step=step, uri=uri, reason=reason,
                   quarantined=bool(quarantined),
                   note="proven damaged: kept for a post-mortem, never loaded again; trying "
                        "the previous commit")

    def _repoint_latest(self, storage: CheckpointStorage) -> None:
        """After a skip, `latest` names the newest commit still usable (or nothing)."""
        if not self.skipped or storage is not self.storage or self.catalog is None:
            return
        newest = self.catalog.newest

        def point() -> None:
            try:
                if newest is None:
                    storage.delete([mf.LATEST])
                else:
                    storage.write(mf.LATEST, newest.dir.encode())
            except Exception as e:  # the next commit rewrites it
                emit("checkpoint_latest_failed", error=short_error(e))

        self._broadcast(point)

    def _emit(self, event: str, **fields: Any) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            emit(event, **fields)

    def _broadcast(self, fn: Callable[[], T]) -> T:
        """Compute on rank 0 and share, so every rank takes the same path."""
        if not dist.is_initialized():
            return fn()
        box = [fn() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]  # type: ignore[return-value]


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
