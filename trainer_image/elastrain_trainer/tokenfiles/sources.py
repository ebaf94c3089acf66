"""Byte ranges of token files, and which files a dataset names: a memory map for file://,
ranged GETs for s3://.

A dataset is one URI, a glob (`*`, `?`, `[...]` in the last path segments, never across a
`/`), or a comma-separated list of them; its shards are every file they name, deduplicated and
sorted by URI, so every rank and every restart sees the same order. An S3 glob is one listing of
the prefix before its first wildcard (which also gives each object's size, so no HEAD per
shard); a named key costs one HEAD, named keys are asked in parallel.

The S3 client is the checkpoint store's (checkpoint/s3.py: the same boto3 config, retries,
credential chain from AWS_* and endpoint, ELASTRAIN_CHECKPOINT_ENDPOINT), so this module does
not import boto3 itself; its errors are matched through the client's own exception classes.
"""

from __future__ import annotations

import fnmatch
import glob
import mmap
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

from elastrain_trainer.tokenfiles.formats import TokenFileError

_GLOB = re.compile(r"[*?\[]")
# Parallel HEADs and header GETs at open: the S3 client's connection pool (checkpoint/s3.py).
OPEN_WORKERS = 16
T = TypeVar("T")
R = TypeVar("R")


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
    """One object read with ranged GETs (`Range: bytes=a-b`), any number of them in parallel.
    `size` known from a listing skips the HEAD."""

    remote = True

    def __init__(self, uri: str, endpoint: str = "", client: Any | None = None,
                 size: int | None = None) -> None:
        self.uri = uri
        self.bucket, self.key = parse_object_uri(uri)
        self.client = client if client is not None else s3_client(self.bucket, endpoint)
        if size is None:
            try:
                size = int(self.client.head_object(Bucket=self.bucket,
                                                   Key=self.key)["ContentLength"])
            except self.client.exceptions.ClientError as e:
                raise TokenFileError(f"{uri}: cannot open: {_code(e)} (endpoint "
                                     f"{self.client.meta.endpoint_url})") from e
        self.size = size

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


def s3_client(bucket: str, endpoint: str = "") -> Any:
    from elastrain_trainer.checkpoint.s3 import S3Storage
    return S3Storage(f"s3://{bucket}", endpoint_url=endpoint or None).client


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", "") or e)


def split_dataset(spec: str) -> list[str]:
    """The URIs and globs of a dataset value (comma-separated)."""
    return [part.strip() for part in spec.split(",") if part.strip()]


def is_glob(uri: str) -> bool:
    return bool(_GLOB.search(uri))


def parallel_map(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """fn over items on up to OPEN_WORKERS threads, in order; the first error (in item order)
    is raised."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(OPEN_WORKERS, len(items)),
                            thread_name_prefix="elastrain-open") as pool:
        return list(pool.map(fn, items))


def open_sources(spec: str, endpoint: str = "") -> list[ByteSource]:
    """Every shard the dataset value names, opened, sorted by URI; errors name the URI or glob."""
    parts = split_dataset(spec)
    if not parts:
        raise TokenFileError(f"{spec!r}: names no token file")
    found: dict[str, ByteSource] = {}
    named: list[str] = []
    clients: dict[str, Any] = {}
    for part in parts:
        if not part.startswith(("file://", "s3://")):
            raise TokenFileError(f"{part}: a token file must be at a file:// or s3:// URI")
        if not is_glob(part):
            named.append(part)
            continue
        matched = (_glob_files(part) if part.startswith("file://")
                   else _glob_objects(part, endpoint, clients))
        if not matched:
            raise TokenFileError(f"{part}: matches no token file")
        found.update((s.uri, s) for s in matched)
    todo = sorted(set(named) - set(found))
    for uri in todo:
        if uri.startswith("s3://"):
            bucket, _ = parse_object_uri(uri)
            if bucket not in clients:
                clients[bucket] = s3_client(bucket, endpoint)
    found.update((s.uri, s) for s in parallel_map(
        lambda uri: _open_one(uri, endpoint, clients), todo))
    return [found[uri] for uri in sorted(found)]


def _open_one(uri: str, endpoint: str, clients: dict[str, Any]) -> ByteSource:
    if uri.startswith("file://"):
        return FileSource(uri)
    return S3Source(uri, endpoint, clients[parse_object_uri(uri)[0]])


def _glob_files(pattern: str) -> list[ByteSource]:
    paths = sorted(p for p in glob.glob(pattern.removeprefix("file://")) if os.path.isfile(p))
    return [FileSource(f"file://{p}") for p in paths]


def _glob_objects(pattern: str, endpoint: str, clients: dict[str, Any]) -> list[ByteSource]:
    """One listing of the prefix before the first wildcard; `*` does not cross a `/`."""
    bucket, key_pattern = parse_object_uri(pattern)
    if bucket not in clients:
        clients[bucket] = s3_client(bucket, endpoint)
    client = clients[bucket]
    prefix = key_pattern[:_GLOB.search(key_pattern).start()]  # type: ignore[union-attr]
    depth = key_pattern.count("/")
    out: list[ByteSource] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                     Prefix=prefix):
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.count("/") == depth and fnmatch.fnmatchcase(key, key_pattern):
                    out.append(S3Source(f"s3://{bucket}/{key}", client=client,
                                        size=int(obj["Size"])))
    except client.exceptions.ClientError as e:
        raise TokenFileError(f"{pattern}: cannot list: {_code(e)} (endpoint "
                             f"{client.meta.endpoint_url})") from e
    return out


def open_source(uri: str, endpoint: str = "") -> ByteSource:
    """One token file (no glob, no list)."""
    if uri.startswith("file://"):
        return FileSource(uri)
    if uri.startswith("s3://"):
        return S3Source(uri, endpoint)
    raise TokenFileError(f"{uri}: a token file must be at a file:// or s3:// URI")
