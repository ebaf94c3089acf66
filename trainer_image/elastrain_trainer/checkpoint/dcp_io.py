"""DCP StorageWriter/StorageReader over a CheckpointStorage, with per-file sha256.

We reuse DCP's file format (FileSystemWriter/Reader) and swap its filesystem for one that
keeps each shard in memory and hands it to the storage in one managed put; so S3 gets a
multipart parallel upload with no temp copy on disk, and every file's digest is known
the moment it is written. Reads verify every file against the manifest before DCP sees
a byte, so a corrupt shard raises CorruptCheckpointError (on every rank, via DCP).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastrain_trainer.checkpoint.manifest import FileDigest, digest, verify_file
from elastrain_trainer.checkpoint.storage import CheckpointStorage, join

CommitFn = Callable[[dict[str, FileDigest], int], None]


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


class StorageFileSystem(FileSystemBase):
    """DCP's filesystem interface; paths are storage keys."""

    def __init__(self, storage: CheckpointStorage,
                 verify: dict[str, FileDigest] | None = None) -> None:
        self.storage = storage
        self.verify = verify  # manifest to check reads against; None while writing
        self.written: dict[str, FileDigest] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str],
                      mode: str) -> Generator[io.IOBase, None, None]:
        key = str(path)
        if mode == "rb":
            data = self.storage.read(key)
            if self.verify is not None:
                verify_file(key.rsplit("/", 1)[-1], data, self.verify)
            yield io.BytesIO(data)
            return
        stream = _UploadOnClose(lambda view: self._put(key, view))
        try:
            yield stream
        except BaseException:
            stream.abort()
            raise
        stream.close()

    def _put(self, key: str, data: memoryview) -> None:
        self.storage.write(key, data)
        self.written[key] = digest(data)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return join(str(path), suffix)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # Only DCP's .metadata goes through here; it is small, so copy + delete is fine.
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


def _digests_key(step_key: str, prefix: str) -> str:
    return join(step_key, f"{prefix}sha256.json")


class CheckpointWriter(FileSystemWriter):
    """Writes one checkpoint directory; the coordinator calls `commit` once DCP finished."""

    def __init__(self, storage: CheckpointStorage, step_key: str, commit: CommitFn) -> None:
        super().__init__(step_key, sync_files=False, overwrite=True)
        # DCP drives any FileSystemBase through this attribute (as its fsspec writer does).
        self._fs = StorageFileSystem(storage)
        self.fs = self._fs  # type: ignore[assignment]
        self.path = step_key
        self._storage = storage
        self._step_key = step_key
        self._commit = commit

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        future.wait()  # FileSystemWriter writes synchronously; re-raise its error here
        # Each rank publishes its own files' digests; the coordinator merges them in finish.
        names = {k.rsplit("/", 1)[-1]: {"size": d.size, "sha256": d.sha256}
                 for k, d in self._fs.written.items()}
        self._storage.write(_digests_key(self._step_key, plan.storage_data.prefix),
                            json.dumps(names).encode())
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
                 files: dict[str, FileDigest]) -> None:
        super().__init__(step_key)
        self.fs = StorageFileSystem(storage, verify=files)  # type: ignore[assignment]
        self.path = step_key

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP retries with per-rank metadata when .metadata fails; we never write those.
            raise FileNotFoundError(f"{self.path}: no per-rank metadata in this format")
        return super().read_metadata(*args, **kwargs)
