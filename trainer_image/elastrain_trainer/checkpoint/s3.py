"""s3:// checkpoint storage over boto3 (AWS or any S3-compatible endpoint such as MinIO).

Credentials come from boto3's default chain (AWS_* env, IRSA, instance profiles). Large
objects go through boto3's managed transfer (multipart, parallel parts) straight from
memory; nothing is staged on local disk. Transient errors are retried with backoff by
botocore's standard retry mode; timeouts are short so a dead endpoint fails a save in
seconds instead of hanging the background uploader.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from elastrain_trainer.checkpoint.problems import (
    ACCESS_DENIED,
    CREDENTIALS,
    NO_BUCKET,
    OTHER,
    STORE_ERROR,
    UNREACHABLE,
    Explanation,
    explain_os_error,
)
from elastrain_trainer.checkpoint.s3_transfer import (
    IN_FLIGHT_PARTS,
    PART_BYTES,
    MultipartWriter,
    ShortReadError,
    crc32_base64,
    read_ranges,
)
from elastrain_trainer.checkpoint.storage import ObjectSizeError
from elastrain_trainer.private_hooks import require

MIB = 1 << 20
TRANSFER = TransferConfig(multipart_threshold=16 * MIB, multipart_chunksize=16 * MIB,
                          max_concurrency=8, use_threads=True)
# payload_signing_enabled=False: over plain http (an in-cluster MinIO) botocore would otherwise
# sha256 every part's body for the SigV4 signature, a second full hash of each checkpoint on
# top of ours; the parts keep their CRC32 checksum header, which the server verifies (over https
# botocore already leaves the payload unsigned when such a checksum is sent).
CLIENT_CONFIG = Config(retries={"max_attempts": 4, "mode": "standard"}, connect_timeout=5,
                       read_timeout=30,
                       s3={"addressing_style": "path", "payload_signing_enabled": False},
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


class _MemoryWriter(io.RawIOBase):
    """A seekable write-only file over preallocated memory, for downloads with no copy."""

    def __init__(self, into: bytearray | memoryview) -> None:
        self._view = memoryview(into).cast("B")
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        n = chunk.nbytes
        if self._pos + n > len(self._view):
            raise ValueError("the object is larger than the memory for it")
        self._view[self._pos:self._pos + n] = chunk
        self._pos += n
        return n


class S3Storage:
    """Keys live under s3://bucket/prefix/."""

    def __init__(self, uri: str, endpoint_url: str | None = None,
                 client: Any | None = None, part_bytes: int = PART_BYTES) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.part_bytes = part_bytes  # of streamed writes and reads (S3's minimum is 5 MiB)
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url,
                                             config=CLIENT_CONFIG)
        _credentials(self.client)  # a botocore without the private hook stops here, not later
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _transfers(self) -> ThreadPoolExecutor:
        # One pool per storage, shared by its streamed writes and reads; made on first use.
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(IN_FLIGHT_PARTS,
                                                thread_name_prefix="elastrain-s3")
            return self._pool

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def explain_error(self, error: BaseException, action: str) -> Explanation:
        return explain(self, error, action)

    def describe_access(self) -> str:
        return describe_access(self)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        # S3 makes an object visible only once the (multipart) upload completes: atomic. Both
        # paths send each body's CRC32, which the store verifies (s3_transfer).
        view = memoryview(data).cast("B")
        if view.nbytes <= self.part_bytes:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key),
                                   Body=cast(IO[bytes], _MemoryReader(view)),
                                   ChecksumCRC32=crc32_base64(view))
            return
        writer = self.open_writer(key)
        try:
            writer.write(view)
        except BaseException:
            writer.abort()
            raise
        writer.close()

    def open_writer(self, key: str) -> MultipartWriter:
        """A stream that uploads as it is written and becomes the object on close() (see
        s3_transfer); abort() drops it."""
        return MultipartWriter(self.client, self.bucket, self._key(key), self._transfers(),
                               part_bytes=self.part_bytes)

    def read_into(self, key: str, into: memoryview,
                  on_range: Callable[[memoryview], None] | None = None) -> None:
        """Fill `into`, exactly the object's size, with ranged parallel GETs; `on_range` sees
        the bytes in order while later ranges still arrive."""
        try:
            read_ranges(self.client, self.bucket, self._key(key), into, self._transfers(),
                        on_range, part_bytes=self.part_bytes)
        except ClientError as e:
            if _is_not_found(e):
                raise FileNotFoundError(f"{self.uri}/{key}") from e
            if _code(e) == "InvalidRange":  # a range past the end: the object is shorter
                raise ObjectSizeError(f"{self.uri}/{key} is shorter than {into.nbytes} "
                                      "bytes") from e
            raise

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


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _is_not_found(e: ClientError) -> bool:
    return _code(e) in ("404", "NoSuchKey", "NotFound")


# --- what an error means (checkpoint.diagnose) ------------------------------------------------
# Codes by which the store answered and refused. Waiting cannot fix them: a pod's credentials
# come from its environment, fixed when its container started.
_REFUSED = {
    "InvalidAccessKeyId": (CREDENTIALS, "the store does not know the access key: check the "
                                        "credentials Secret"),
    "SignatureDoesNotMatch": (CREDENTIALS, "the secret access key does not match the access key: "
                                           "check the credentials Secret"),
    "InvalidToken": (CREDENTIALS, "the session token is invalid"),
    "ExpiredToken": (CREDENTIALS, "the session token expired"),
    "AuthorizationHeaderMalformed": (CREDENTIALS, "the request was signed for another region "
                                                  "than the bucket's: set spec.checkpoint.region"),
    "AccessDenied": (ACCESS_DENIED, "the credentials may not do this: grant {permission} on "
                                    "the bucket and prefix"),
    "AllAccessDisabled": (ACCESS_DENIED, "all access to the bucket is disabled"),
    "NoSuchBucket": (NO_BUCKET, "bucket {bucket!r} does not exist at this endpoint"),
    "InvalidBucketName": (NO_BUCKET, "{bucket!r} is not a valid bucket name"),
    "PermanentRedirect": (NO_BUCKET, "bucket {bucket!r} is in another region or at another "
                                     "endpoint"),
}
# The store's own trouble, which it may recover from (any 5xx as well).
_TROUBLE = {"SlowDown": "the store throttles requests", "RequestTimeout": "the store timed out",
            "XMinioStorageFull": "the store is out of space",
            "XMinioServerNotInitialized": "the store is still starting"}
_PERMISSIONS = {"list": "s3:ListBucket", "write": "s3:PutObject", "read": "s3:GetObject",
                "delete": "s3:DeleteObject",
                "save": "s3:PutObject, s3:GetObject, s3:ListBucket and s3:DeleteObject"}
# botocore's names of where credentials came from (Credentials.method).
_SOURCES = {
    "env": "environment variables AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
    "shared-credentials-file": "the shared credentials file",
    "config-file": "the AWS config file",
    "explicit": "explicit keys",
    "assume-role-with-web-identity": "a web identity token, AWS_ROLE_ARN and "
                                     "AWS_WEB_IDENTITY_TOKEN_FILE (IRSA)",
    "container-role": "the container credentials endpoint (EKS Pod Identity)",
    "iam-role": "instance metadata: the node's IAM role",
}
_STATIC = frozenset({"env", "shared-credentials-file", "config-file", "explicit"})


def explain(storage: S3Storage, error: BaseException, action: str) -> Explanation:
    """What `error`, raised by `action` on this storage, means (see checkpoint.diagnose)."""
    if isinstance(error, ClientError):
        return _explain_response(storage, error, action)
    if isinstance(error, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return Explanation(CREDENTIALS, True, f"{type(error).__name__}: {error}")
    if isinstance(error, ConnectionError | HTTPClientError):
        # Our own words: the raw text of a reset connection reads like a lost training peer.
        return Explanation(UNREACHABLE, False,
                           f"{type(error).__name__}: no answer from the endpoint")
    if isinstance(error, ShortReadError):
        return Explanation(UNREACHABLE, False, str(error))
    if type(error).__module__.split(".")[0] in ("urllib3", "http"):
        # A body cut short under boto3 (urllib3's ProtocolError, http.client's IncompleteRead).
        return Explanation(UNREACHABLE, False, f"{type(error).__name__}: the connection broke")
    if isinstance(error, OSError):
        return explain_os_error(error)
    return Explanation(OTHER, False, f"{type(error).__name__}: {error}")


def _explain_response(storage: S3Storage, error: ClientError, action: str) -> Explanation:
    info = error.response.get("Error", {})
    code = str(info.get("Code", ""))
    status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    said = f"{code}: {info.get('Message') or error}"
    if code in _REFUSED:
        kind, hint = _REFUSED[code]
        return Explanation(kind, True, code + ": " + hint.format(
            bucket=storage.bucket, permission=_PERMISSIONS.get(action, "access")))
    if code in _TROUBLE or status >= 500:
        return Explanation(STORE_ERROR, False, f"{_TROUBLE.get(code, 'the store failed')} "
                                               f"({said})")
    if status == 403:
        return Explanation(ACCESS_DENIED, True, f"access denied ({said}): grant "
                                                f"{_PERMISSIONS.get(action, 'access')}")
    return Explanation(OTHER, True, said)


def describe_access(storage: S3Storage) -> str:
    """Endpoint and credential source, for messages (never the secret)."""
    endpoint = storage.client.meta.endpoint_url
    creds = _credentials(storage.client)
    if creds is None:
        who = ("no credentials found: looked in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, the "
               "shared credentials file, a web identity token and instance metadata")
    else:
        method = str(getattr(creds, "method", "") or "unknown")
        source = _SOURCES.get(method, method)
        who = (f"access key {_masked_key(storage.client)} from {source}" if method in _STATIC
               else f"credentials from {source}")
    return f"endpoint {endpoint}, {who}"


def _credentials(client: Any) -> Any:
    # The client's own resolved credentials (botocore keeps them on its request signer; a
    # private hook, elastrain_trainer.private_hooks); None when none were found.
    why = "to say which credentials a refused request used"
    signer = require(client, "_request_signer", library="botocore", owner_name="BaseClient",
                     needed_for=why)
    return require(signer, "_credentials", library="botocore", owner_name="RequestSigner",
                   needed_for=why)


def _masked_key(client: Any) -> str:
    creds = _credentials(client)
    if creds is None or getattr(creds, "method", "") not in _STATIC:
        return "(temporary)"
    key = str(getattr(creds, "access_key", "") or "")
    return "****" + key[-4:] if len(key) > 8 else "****"
