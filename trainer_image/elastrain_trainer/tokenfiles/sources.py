"""Byte ranges of a token file: a memory map for file://, ranged GETs for s3://.

The S3 client is the checkpoint store's (checkpoint/s3.py: the same boto3 config, retries,
credential chain from AWS_* and endpoint, ELASTRAIN_CHECKPOINT_ENDPOINT), so this module does
not import boto3 itself; its errors are matched through the client's own exception classes.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Protocol
from urllib.parse import urlparse

from elastrain_trainer.tokenfiles.formats import TokenFileError


class ByteSource(Protocol):
    """A read-only object of `size` bytes; `remote` ones are worth caching and prefetching."""

    uri: str
    size: int
    remote: bool

    def read(self, start: int, end: int) -> bytes | memoryview: ...


class FileSource:
    """A file mapped read-only: the page cache is its cache, reads are zero-copy views."""

    remote = False

    def __init__(self, uri: str) -> None:
        self.uri = uri
        path = uri.removeprefix("file://")
        try:
            with open(path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except OSError as e:
            raise TokenFileError(f"{uri}: cannot open: {e.strerror or e}") from e
        if self._map is not None:
            self._map.madvise(mmap.MADV_RANDOM)  # windows are read in shuffled order

    def read(self, start: int, end: int) -> bytes | memoryview:
        if self._map is None:
            return b""
        return memoryview(self._map)[start:end]


def parse_object_uri(uri: str) -> tuple[str, str]:
    """("bucket", "key") of s3://bucket/key."""
    parts = urlparse(uri)
    key = parts.path.lstrip("/")
    if parts.scheme != "s3" or not parts.netloc or not key:
        raise TokenFileError(f"{uri}: a dataset on S3 must be s3://bucket/key")
    return parts.netloc, key


class S3Source:
    """One object read with ranged GETs (`Range: bytes=a-b`), any number of them in parallel."""

    remote = True

    def __init__(self, uri: str, endpoint: str = "", client: Any | None = None) -> None:
        self.uri = uri
        self.bucket, self.key = parse_object_uri(uri)
        if client is None:
            from elastrain_trainer.checkpoint.s3 import S3Storage
            client = S3Storage(f"s3://{self.bucket}", endpoint_url=endpoint or None).client
        self.client = client
        try:
            head = client.head_object(Bucket=self.bucket, Key=self.key)
        except client.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            raise TokenFileError(f"{uri}: cannot open: {code or e} (endpoint "
                                 f"{client.meta.endpoint_url})") from e
        self.size = int(head["ContentLength"])

    def read(self, start: int, end: int) -> bytes | memoryview:
        if end <= start:
            return b""
        body = self.client.get_object(Bucket=self.bucket, Key=self.key,
                                      Range=f"bytes={start}-{end - 1}")["Body"]
        data: bytes = body.read()
        if len(data) != end - start:
            raise TokenFileError(f"{self.uri}: asked for bytes {start}-{end - 1}, got {len(data)} "
                                 "bytes (the object changed or shrank while training)")
        return data


def open_source(uri: str, endpoint: str = "") -> ByteSource:
    if uri.startswith("file://"):
        return FileSource(uri)
    if uri.startswith("s3://"):
        return S3Source(uri, endpoint)
    raise TokenFileError(f"{uri}: a token file must be at a file:// or s3:// URI")
