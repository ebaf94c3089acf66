"""s3:// checkpoint storage over boto3 (AWS or any S3-compatible endpoint such as MinIO).

Credentials come from boto3's default chain (AWS_* env, IRSA, instance profiles). Large
objects go through boto3's managed transfer (multipart, parallel parts) straight from
memory; nothing is staged on local disk. Transient errors are retried with backoff by
botocore's standard retry mode; timeouts are short so a dead endpoint fails a save in
seconds instead of hanging the background uploader.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import IO, Any, cast

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

MIB = 1 << 20
TRANSFER = TransferConfig(multipart_threshold=16 * MIB, multipart_chunksize=16 * MIB,
                          max_concurrency=8, use_threads=True)
CLIENT_CONFIG = Config(retries={"max_attempts": 4, "mode": "standard"}, connect_timeout=5,
                       read_timeout=30, s3={"addressing_style": "path"},
                       max_pool_connections=16)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """("bucket", "prefix") of s3://bucket/prefix; ValueError names the variable."""
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise ValueError(f"ELASTRAIN_CHECKPOINT_URI={uri!r} must look like s3://bucket/prefix")
    return bucket, prefix.strip("/")


class _MemoryReader(io.RawIOBase):
    """A seekable read-only file over a buffer, so uploads need no copy of the bytes."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos:self._pos + len(buffer)]
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        self._pos += n
        return n


class S3Storage:
    """Keys live under s3://bucket/prefix/."""

    def __init__(self, uri: str, endpoint_url: str | None = None,
                 client: Any | None = None) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url,
                                             config=CLIENT_CONFIG)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        # S3 makes an object visible only once the (multipart) upload completes: atomic.
        self.client.upload_fileobj(cast(IO[bytes], _MemoryReader(data)), self.bucket,
                                   self._key(key),
                                   Config=TRANSFER)

    def read(self, key: str) -> bytes:
        buf = io.BytesIO()
        try:
            self.client.download_fileobj(self.bucket, self._key(key), buf, Config=TRANSFER)
        except ClientError as e:
            if _is_not_found(e):
                raise FileNotFoundError(f"{self.uri}/{key}") from e
            raise
        return buf.getvalue()

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if _is_not_found(e):
                return False
            raise
        return True

    def list(self, prefix: str = "") -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=root + prefix)
        for page in pages:
            keys.extend(obj["Key"][len(root):] for obj in page.get("Contents", []))
        return sorted(keys)

    def delete(self, keys: Iterable[str]) -> None:
        batch: list[Any] = [{"Key": self._key(k)} for k in keys]
        for i in range(0, len(batch), 1000):  # the DeleteObjects limit
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": batch[i:i + 1000], "Quiet": True})


def _is_not_found(e: ClientError) -> bool:
    code = str(e.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")
