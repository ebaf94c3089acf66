"""DCP StorageWriter/StorageReader over a CheckpointStorage, with per-file sha256.

We reuse DCP's file format (FileSystemWriter/Reader) and swap its filesystem for one over
our storage. On a StreamingStorage (s3://) a shard is uploaded in parts while DCP is still
serialising it and hashed on the way, with no whole-shard buffer; a read fetches the shard's
ranges in parallel into one preallocated buffer and hashes them as they arrive. Other
backends get each shard in memory and store it with one write. Either way every file's
digest is known the moment it is written, and reads verify every file against the manifest
before DCP sees a byte, so a corrupt shard raises CorruptCheckpointError (on every rank,
via DCP). A read that fails for any other reason (the store reset, throttled, timed out) raises
StoreFault instead, which proves nothing about the checkpoint (checkpoint.read_faults).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import IO, Any, TypeVar, cast

import torch
import torch.serialization
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastrain_trainer import fault_injection
from elastrain_trainer.checkpoint.manifest import (
    CorruptCheckpointError,
    FileDigest,
    digest,
    verify_file,
)
from elastrain_trainer.checkpoint.read_faults import store_fault
from elastrain_trainer.checkpoint.storage import (
    CheckpointStorage,
    ObjectSizeError,
    StreamingStorage,
    join,
)
from elastrain_trainer.private_hooks import import_private, require, require_dcp_hooks

# torch internals (elastrain_trainer.private_hooks): a worker whose torch lacks one stops here.
require_dcp_hooks()
narrow_tensor_by_index = import_private(
    "torch.distributed._shard._utils", "narrow_tensor_by_index", library="torch",
    needed_for="to take the part of a saved tensor a read asks for (checkpoint/dcp_io.py)")
_SWAPPED_FS = "to put DCP's files in elastrain's storage, not the local disk (checkpoint/dcp_io.py)"

CommitFn = Callable[[dict[str, FileDigest], int], None]
T = TypeVar("T")


class _UploadOnClose(io.BytesIO):
    """A shard buffer that becomes an object when DCP closes it (and only if it succeeded)."""

    def __init__(self, on_close: Callable[[memoryview], None]) -> None:
        super().__init__()
        self._on_close: Callable[[memoryview], None] | None = on_close

    def abort(self) -> None:
        self._on_close = None

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None and not self.closed:
            view = self.getbuffer()
            try:
                on_close(view)
            finally:
                view.release()
        super().close()


def _closing(stream: _UploadOnClose) -> Generator[io.IOBase, None, None]:
    """Yield a buffer that becomes an object on a clean exit, and nothing on an error."""
    try:
        yield stream
    except BaseException:
        stream.abort()
        raise
    stream.close()


class _ViewReader(io.RawIOBase):
    """A seekable read-only stream over memory: DCP's views and torch.load read it in place."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self.view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self.view[self._pos:self._pos + len(buffer)]
        n = chunk.nbytes
        memoryview(buffer).cast("B")[:n] = chunk
        self._pos += n
        return n


def _tensor_in_place(saved: memoryview) -> torch.Tensor:
    """The tensor DCP torch.save'd into `saved`, as a view of those bytes (no copy).

    torch.load copies every storage out of a stream into new memory; given the whole
    record's memory (as it does for mmap=True), _load slices its storages out of it instead.
    """
    reader = torch._C.PyTorchFileReader(cast(IO[bytes], _ViewReader(saved)))
    memory = torch.frombuffer(saved, dtype=torch.uint8).untyped_storage()
    tensor = torch.serialization._load(  # type: ignore[no-untyped-call]
        reader, "cpu", torch._weights_only_unpickler, overall_storage=memory, weights_only=True)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"a tensor record holds a {type(tensor).__name__}")
    return tensor


class StorageFileSystem(FileSystemBase):
    """DCP's filesystem interface; paths are storage keys."""

    def __init__(self, storage: CheckpointStorage,
                 verify: dict[str, FileDigest] | None = None) -> None:
        self.storage = storage
        self.verify = verify  # manifest to check reads against; None while writing
        self.written: dict[str, FileDigest] = {}
        self._staged: dict[str, bytes] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str],
                      mode: str) -> Generator[io.IOBase, None, None]:
        key = str(path)
        if mode == "rb":
            with self._read_stream(key) as stream:
                yield stream
            return
        if key.endswith(".tmp"):
            # DCP writes .metadata as a .tmp and renames it; keep it here until the rename.
            staged = _UploadOnClose(lambda view: self._staged.__setitem__(key, bytes(view)))
            yield from _closing(staged)
            return
        if isinstance(self.storage, StreamingStorage):
            writer = self.storage.open_writer(key)
            try:
                yield writer  # type: ignore[misc]
            except BaseException:
                writer.abort()
                raise
            writer.close()
            assert writer.digest is not None
            self.written[key] = FileDigest(*writer.digest)
            return
        yield from _closing(_UploadOnClose(lambda view: self._put(key, view)))

    @contextmanager
    def _read_stream(self, key: str) -> Generator[io.IOBase, None, None]:
        name = key.rsplit("/", 1)[-1]
        expected = self.verify.get(name) if self.verify is not None else None
        if expected is None or not isinstance(self.storage, StreamingStorage):
            data = self._reading(key, lambda: self.storage.read(key))
            if self.verify is not None:
                verify_file(name, data, self.verify)
            yield io.BytesIO(data)
            return
        # torch.empty, not bytearray: no pass over the memory to zero it first.
        memory = torch.empty(expected.size, dtype=torch.uint8)
        view = memoryview(memory.numpy()).cast("B")  # type: ignore[arg-type]
        hasher = hashlib.sha256()
        storage = self.storage
        self._reading(key, lambda: storage.read_into(key, view, hasher.update))
        if hasher.hexdigest() != expected.sha256:
            raise CorruptCheckpointError(
                f"{name}: sha256 {hasher.hexdigest()[:12]} != manifest {expected.sha256[:12]}")
        yield _ViewReader(view)

    def _reading(self, key: str, read: Callable[[], T]) -> T:
        """A storage read whose failure says what it proves: a missing object or one of another
        size is damage (CorruptCheckpointError); anything else is the store's (StoreFault)."""
        try:
            return read()
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{key.rsplit('/', 1)[-1]} is missing") from None
        except ObjectSizeError as e:
            raise CorruptCheckpointError(str(e)) from None
        except CorruptCheckpointError:
            raise
        except Exception as e:
            if self.verify is None:
                raise  # writing: the save's own error handling reports it
            # Our own plain exception, not the library's: DCP pickles it to every rank.
            raise store_fault(self.storage, e, action="read", key=key) from None

    def _put(self, key: str, data: memoryview) -> None:
        self.storage.write(key, data)
        self.written[key] = digest(data)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return join(str(path), suffix)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # Only DCP's .metadata goes through here, written as a staged .tmp (see create_stream).
        staged = self._staged.pop(str(path), None)
        if staged is not None:
            self._put(str(new_path), memoryview(staged))
            return
        data = self.storage.read(str(path))
        self._put(str(new_path), memoryview(data))
        self.storage.delete([str(path)])
        self.written.pop(str(path), None)

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass  # object stores have no directories; LocalStorage creates parents on write

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never auto-selected by DCP; always passed explicitly

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.storage.exists(str(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.storage.delete([str(path)])


def _rank_of(prefix: str) -> int:
    """The rank in DCP's file prefix (`__<rank>_`)."""
    return int(prefix.strip("_"))


def _digests_key(step_key: str, prefix: str) -> str:
    return join(step_key, f"{prefix}sha256.json")


class DirectoryTakenError(RuntimeError):
    """A save's directory holds another writer's objects: nothing is written into it."""


class CheckpointWriter(FileSystemWriter):
    """Writes one checkpoint directory; the coordinator calls `commit` once DCP finished."""

    def __init__(self, storage: CheckpointStorage, step_key: str, commit: CommitFn) -> None:
        super().__init__(step_key, sync_files=False, overwrite=True)
        require(self, "fs", library="torch", needed_for=_SWAPPED_FS,
                owner_name="FileSystemWriter")
        # DCP drives any FileSystemBase through this attribute (as its fsspec writer does).
        self._fs = StorageFileSystem(storage)
        self.fs = self._fs  # type: ignore[assignment]
        self.path = step_key
        self._storage = storage
        self._step_key = step_key
        self._commit = commit

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator, before any rank writes (off the training thread in an async
        save): a directory that already holds objects was written by another writer since
        this one's catalog was read (a node cut off from its world while the world committed
        the same step), and writing into it would damage that checkpoint. The save fails
        instead, like any failed save."""
        held = self._storage.list(self._step_key + "/")
        if held:
            raise DirectoryTakenError(f"{self._step_key} already holds {len(held)} object(s) "
                                      "written by another writer since this one read the "
                                      "checkpoint root; not written into")
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        future.wait()  # FileSystemWriter writes synchronously; re-raise its error here
        # Each rank publishes its own files' digests; the coordinator merges them in finish.
        names = {k.rsplit("/", 1)[-1]: {"size": d.size, "sha256": d.sha256}
                 for k, d in self._fs.written.items()}
        self._storage.write(_digests_key(self._step_key, plan.storage_data.prefix),
                            json.dumps(names).encode())
        fault_injection.during_save(_rank_of(plan.storage_data.prefix))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)  # writes .metadata after every shard exists
        files: dict[str, FileDigest] = {}
        for rank in range(len(results)):
            doc = json.loads(self._storage.read(_digests_key(self._step_key, f"__{rank}_")))
            files.update({n: FileDigest(int(d["size"]), str(d["sha256"])) for n, d in doc.items()})
        for key, d in self._fs.written.items():
            files[key.rsplit("/", 1)[-1]] = d
        self._commit(files, len(results))


class CheckpointReader(FileSystemReader):
    """Reads one committed checkpoint directory, verifying every file it touches."""

    def __init__(self, storage: CheckpointStorage, step_key: str,
                 files: dict[str, FileDigest], metadata: Metadata | None = None) -> None:
        super().__init__(step_key)
        for name in ("fs", "storage_data", "load_id"):
            require(self, name, library="torch", needed_for=_SWAPPED_FS,
                    owner_name="FileSystemReader")
        self._storage = storage
        self.fs = StorageFileSystem(storage, verify=files)  # type: ignore[assignment]
        self.path = step_key
        # Read beforehand (CheckpointManager): DCP turns a failed metadata read into an
        # AssertionError whose text is all that is left of the cause (a reset? a bad checksum?).
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read_data, except that a tensor is copied into its target straight from the
        verified shard in memory (DCP torch.loads it into a new tensor and copies that)."""
        if not isinstance(self._storage, StreamingStorage):
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            path = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(path, []).append(item)
        for path, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, path), "rb") as stream:
                assert isinstance(stream, _ViewReader)
                for item in items:
                    self._read_item(stream.view, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, shard: memoryview, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        if info.transform_descriptors:
            raise ValueError(f"{info.relative_path}: stream transforms "
                             f"{info.transform_descriptors} are not ours")
        saved = shard[info.offset:info.offset + info.length]
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(saved.tobytes()))
            return
        tensor = narrow_tensor_by_index(_tensor_in_place(saved), item.storage_offsets,
                                        item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            # The bytes verified: the checkpoint is sound, this model is not the one saved.
            raise ValueError(f"{item.storage_index}: saved size {tensor.size()} != "
                             f"{target.size()} in this model")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP retries with per-rank metadata when .metadata fails; we never write those.
            raise FileNotFoundError(f"{self.path}: no per-rank metadata in this format")
        if self._metadata is None:
            return super().read_metadata(*args, **kwargs)
        meta = getattr(self._metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        self._metadata.storage_meta = meta
        return self._metadata


def root_cause(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's wrapper."""
    if isinstance(error, CheckpointException) and error.failures:
        return error.failures[min(error.failures)][0]
    return error


def short_error(error: BaseException) -> str:
    """The root cause in one line (DCP wraps each rank's error with its traceback)."""
    if isinstance(error, CheckpointException):
        causes = {f"{type(exc).__name__}: {exc}" for exc, _tb in error.failures.values()}
        text = "; ".join(sorted(causes))
    else:
        text = f"{type(error).__name__}: {error}"
    return text if len(text) < 600 else text[:600] + "..."
