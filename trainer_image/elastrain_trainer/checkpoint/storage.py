"""The CheckpointStorage protocol: a flat key -> bytes store under one root URI.

Backends: local.py (file://), s3.py (s3://) and fsspec_storage.py (gs://, az://, abfs://);
backends.open_storage picks one by scheme (this module imports none of them).
Keys are '/'-separated and relative to the root. A write is all-or-nothing for its key (a
reader sees the old object, the whole new one, or nothing), which is what commit markers and
`latest` pointers rely on. A missing key is FileNotFoundError; an object of another size than
the reader expected is ObjectSizeError; every other exception is the store's trouble and proves
nothing about the bytes stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from elastrain_trainer.checkpoint.problems import Explanation


class ObjectSizeError(ValueError):
    """The object exists but is not the size the reader was told (read_into)."""


@runtime_checkable
class CheckpointStorage(Protocol):
    """Object storage rooted at `uri`."""

    @property
    def uri(self) -> str: ...

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store `data` under `key`, replacing any previous object, atomically."""

    def read(self, key: str) -> bytes:
        """The whole object; FileNotFoundError if the key does not exist."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]:
        """All keys starting with `prefix`, sorted."""

    def delete(self, keys: Iterable[str]) -> None:
        """Remove these keys; missing keys are not an error."""


class ObjectWriter(Protocol):
    """A stream that becomes one object on close(); `digest` then holds (size, sha256)."""

    digest: tuple[int, str] | None

    def write(self, data: bytes | bytearray | memoryview) -> int: ...

    def tell(self) -> int: ...

    def close(self) -> None: ...

    def abort(self) -> None:
        """Drop what was written: the object does not appear."""


@runtime_checkable
class StreamingStorage(CheckpointStorage, Protocol):
    """A backend that also streams large objects (s3.py): writes upload while the caller still
    writes, hashing as they go; reads fill preallocated memory with parallel ranges."""

    def open_writer(self, key: str) -> ObjectWriter: ...

    def read_into(self, key: str, into: memoryview,
                  on_range: Callable[[memoryview], None] | None = None) -> None:
        """Fill `into`, exactly the object's size (ObjectSizeError if it is another size);
        `on_range` sees the bytes in order."""


def join(*parts: str) -> str:
    """Join key parts with '/', ignoring empty parts."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


@runtime_checkable
class ExplainingStorage(CheckpointStorage, Protocol):
    """A backend that says what its own errors mean (checkpoint.diagnose): every one shipped.
    A storage of the user's own need not: its errors are read as OSErrors."""

    def explain_error(self, error: BaseException, action: str) -> Explanation:
        """What `error`, raised by `action` (list, write, read, delete, save), means."""

    def describe_access(self) -> str:
        """Where and as whom this storage reaches its store, for messages (never a secret)."""
