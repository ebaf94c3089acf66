"""The CheckpointStorage protocol: a flat key -> bytes store under one root URI.

Backends: local.py (file://) and s3.py (s3://). Keys are '/'-separated and relative to
the root. A write is all-or-nothing for its key (a reader sees the old object, the whole
new one, or nothing), which is what commit markers and `latest` pointers rely on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable


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


def join(*parts: str) -> str:
    """Join key parts with '/', ignoring empty parts."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def open_storage(uri: str, endpoint: str = "") -> CheckpointStorage:
    """The backend for a file:// or s3:// URI (boto3 is imported only for s3://)."""
    if uri.startswith("file://"):
        from elastrain_trainer.checkpoint.local import LocalStorage

        return LocalStorage(uri.removeprefix("file://"))
    if uri.startswith("s3://"):
        from elastrain_trainer.checkpoint.s3 import S3Storage

        return S3Storage(uri, endpoint_url=endpoint or None)
    raise ValueError(f"ELASTRAIN_CHECKPOINT_URI={uri!r} must start with file:// or s3://")
