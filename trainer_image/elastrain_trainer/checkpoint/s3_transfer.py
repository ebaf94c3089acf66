"""Part of the s3:// adapter (s3.py): streamed multipart uploads and ranged parallel reads.

Upload: the bytes a writer is handed fill fixed-size part buffers; each full part is hashed
(sha256, in order, on one hashing thread) and uploaded (UploadPart, on the storage's pool) while
the caller goes on writing, so serialising, hashing and the network overlap and no whole-object
buffer exists. A small object is one PutObject. The object appears only when close() completes
the upload; abort() (or any failure) aborts it, so a partial object is never visible.

Every PutObject and UploadPart carries the CRC32 of its bytes, computed here from the bytes
handed over, and the store refuses a body that does not match it: the bytes stored are the bytes
sent, also where botocore's own checksums are turned off (AWS_REQUEST_CHECKSUM_CALCULATION=
when_required, common with S3-compatible stores). Given a checksum, botocore computes none.

Read: the object's byte ranges are fetched in parallel straight into preallocated memory, and
the caller hashes the finished prefix in order while later ranges are still arriving.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import threading
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from elastrain_trainer.checkpoint.storage import ObjectSizeError
from elastrain_trainer.events import emit
from elastrain_trainer.private_hooks import TESTED, installed

MIB = 1 << 20
PART_BYTES = 16 * MIB
IN_FLIGHT_PARTS = 8  # per writer; also the read concurrency
RANGE_ATTEMPTS = 3   # a range whose body breaks mid-read is fetched again


class _Part:
    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self.hashed: Future[None] | None = None
        self.uploaded: Future[dict[str, Any]] | None = None

    def wait(self) -> None:
        for f in (self.hashed, self.uploaded):
            if f is not None:
                f.result()


class MultipartWriter(io.RawIOBase):
    """A write-only stream that becomes one object on close(); `digest` then holds its
    (size, sha256)."""

    def __init__(self, client: Any, bucket: str, key: str, pool: ThreadPoolExecutor,
                 part_bytes: int = PART_BYTES, in_flight: int = IN_FLIGHT_PARTS) -> None:
        super().__init__()
        self._client, self._bucket, self._key, self._pool = client, bucket, key, pool
        self._part_bytes, self._in_flight = part_bytes, in_flight
        self._hasher = hashlib.sha256()
        self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="elastrain-sha256")
        self._pending: deque[_Part] = deque()
        self._part: _Part | None = None
        self._fill = 0
        self._size = 0
        self._upload_id: str | None = None
        self._etags: list[Future[dict[str, Any]]] = []
        self.digest: tuple[int, str] | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n, done = view.nbytes, 0
        while done < n:
            part = self._part or self._take_part()
            room = self._part_bytes - self._fill
            take = min(room, n - done)
            part.buffer[self._fill:self._fill + take] = view[done:done + take]
            self._fill += take
            done += take
            if self._fill == self._part_bytes:
                self._ship()
        self._size += n
        return n

    def _take_part(self) -> _Part:
        if len(self._pending) >= self._in_flight:
            part = self._pending.popleft()
            part.wait()  # back-pressure: at most `in_flight` parts in memory and in flight
        else:
            part = _Part(self._part_bytes)
        self._part, self._fill = part, 0
        return part

    def _ship(self) -> None:
        """Hash and upload the current part (asynchronously)."""
        part, fill = self._part, self._fill
        assert part is not None
        if self._upload_id is None:
            self._upload_id = self._client.create_multipart_upload(
                Bucket=self._bucket, Key=self._key, ChecksumAlgorithm="CRC32")["UploadId"]
        view = memoryview(part.buffer)[:fill]
        part.hashed = self._hash_pool.submit(self._hasher.update, view)
        number = len(self._etags) + 1
        part.uploaded = self._pool.submit(self._upload_part, number, view)
        self._etags.append(part.uploaded)
        self._pending.append(part)
        self._part, self._fill = None, 0

    def _upload_part(self, number: int, view: memoryview) -> dict[str, Any]:
        checksum = crc32_base64(view)
        response = self._client.upload_part(Bucket=self._bucket, Key=self._key,
                                            UploadId=self._upload_id, PartNumber=number,
                                            Body=_Body(view), ChecksumCRC32=checksum)
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32": checksum}

    def close(self) -> None:
        """Complete the object (or abort it if anything failed); idempotent."""
        if self.closed:
            return
        try:
            if self._upload_id is None:
                body = memoryview(self._part.buffer)[:self._fill] if self._part else b""
                self._hasher.update(body)
                self._client.put_object(Bucket=self._bucket, Key=self._key, Body=_Body(body),
                                        ChecksumCRC32=crc32_base64(body))
            else:
                if self._fill:
                    self._ship()
                parts = [f.result() for f in self._etags]
                for part in self._pending:
                    part.wait()
                self._client.complete_multipart_upload(
                    Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts})
            self.digest = (self._size, self._hasher.hexdigest())
        except BaseException:
            self.abort()
            raise
        finally:
            self._release()
            super().close()

    def abort(self) -> None:
        """Drop what was written; the object does not appear (or keeps its old bytes)."""
        for part in self._pending:
            for f in (part.hashed, part.uploaded):
                if f is not None:
                    f.cancel()
        for part in self._pending:
            with contextlib.suppress(BaseException):  # the upload is being aborted anyway
                part.wait()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key,
                                                UploadId=upload_id)
        self._release()
        if not self.closed:
            super().close()

    def _release(self) -> None:
        self._hash_pool.shutdown(wait=True)
        self._pending.clear()
        self._part = None


def crc32_base64(data: bytes | bytearray | memoryview) -> str:
    """S3's x-amz-checksum-crc32: the big-endian CRC32, base64 (zlib releases the GIL)."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


class ShortReadError(ConnectionError):
    """A range's body ended before its bytes did, on every attempt: the connection's fault, not
    the object's (the object's size was what the reader expected)."""


class _Body(io.RawIOBase):
    """A seekable request body over memory (botocore re-reads it on retries and checksums)."""

    def __init__(self, view: memoryview | bytes) -> None:
        self._view = memoryview(view).cast("B")
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
        n = chunk.nbytes
        memoryview(buffer).cast("B")[:n] = chunk
        self._pos += n
        return n


def read_ranges(client: Any, bucket: str, key: str, into: memoryview, pool: ThreadPoolExecutor,
                on_range: Callable[[memoryview], None] | None = None,
                part_bytes: int = PART_BYTES) -> None:
    """Fill `into` (exactly the object's size) with the object, ranges fetched in parallel;
    `on_range` sees each range in order as soon as it and all before it have arrived."""
    size = into.nbytes
    starts = range(0, size, part_bytes) if size else range(0)
    cancel = threading.Event()
    futures = [pool.submit(_get_range, client, bucket, key, into[s:min(s + part_bytes, size)],
                           s, size, cancel) for s in starts]
    try:
        for s, f in zip(starts, futures, strict=True):
            f.result()
            if on_range is not None:
                on_range(into[s:min(s + part_bytes, size)])
    except BaseException:
        cancel.set()
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                f.exception()  # wait: no thread may still write into `into` afterwards
        raise


def _get_range(client: Any, bucket: str, key: str, into: memoryview, start: int,
               expected_total: int, cancel: threading.Event) -> None:
    end = start + into.nbytes - 1
    for attempt in range(RANGE_ATTEMPTS):
        if cancel.is_set():
            return
        response = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
        body = response["Body"]
        total = str(response.get("ContentRange", "")).rpartition("/")[2]
        if total.isdigit() and int(total) != expected_total:
            body.close()
            raise ObjectSizeError(f"{key} is {total} bytes, not the {expected_total} expected")
        try:
            got = _read_body_into(body, into)
        except Exception as e:  # a reset, a timeout, urllib3's or http.client's protocol errors
            if attempt == RANGE_ATTEMPTS - 1:
                # The error's type, not its text: "Connection reset by peer" would read like a
                # lost training peer (faults.peer_lost).
                raise ShortReadError(f"reading {key} bytes {start}-{end}: the connection broke "
                                     f"on {RANGE_ATTEMPTS} attempts ({type(e).__name__})") from e
            continue
        finally:
            body.close()
        if got < into.nbytes and attempt < RANGE_ATTEMPTS - 1:
            continue  # the body ended early (the connection dropped): fetch the range again
        if got > into.nbytes:
            raise ObjectSizeError(f"{key}: bytes {start}-{end} gave more than the "
                                  f"{into.nbytes} bytes asked for")
        if got < into.nbytes:
            raise ShortReadError(f"{key}: bytes {start}-{end} gave {got} of {into.nbytes} "
                                 f"bytes on {RANGE_ATTEMPTS} attempts (connection cut short)")
        return


_no_direct_read_said = threading.Event()


def _say_no_direct_read(body: Any) -> None:
    """One `private_hook_missing` event per process: reads work, but copy every range."""
    if _no_direct_read_said.is_set():
        return
    _no_direct_read_said.set()
    emit("private_hook_missing", hook="StreamingBody._raw_stream._fp",
         body=type(body).__qualname__, botocore=installed("botocore"),
         urllib3=installed("urllib3"), tested=f"botocore{TESTED['botocore']}, "
                                              f"urllib3{TESTED['urllib3']}",
         effect="S3 reads copy every range (slower, still correct)")


def _read_body_into(body: Any, into: memoryview) -> int:
    """Read a response body into `into`, straight from the socket where the stream allows.

    urllib3's own readinto() reads into a new bytes object and copies it over, several copies
    of every range made while holding the GIL (seen in a profile of a 3.6 GB load: the range
    threads took turns copying). http.client's response beneath it reads into the buffer
    given; botocore asks urllib3 for the body undecoded, so its bytes are the same.
    `_raw_stream` and `_fp` are private (elastrain_trainer.private_hooks): without them the
    copying path is taken, still correct but slower, and said once per process.
    """
    raw: Any = getattr(body, "_raw_stream", None)
    direct: Any = getattr(raw, "_fp", None)
    if not callable(getattr(direct, "readinto", None)):
        _say_no_direct_read(body)
        direct = raw if callable(getattr(raw, "readinto", None)) else None
    got = 0
    while got < into.nbytes:
        if direct is not None:
            n = direct.readinto(into[got:])
        else:
            chunk = body.read(into.nbytes - got)
            n = len(chunk)
            into[got:got + n] = chunk
        if not n:
            break
        got += n
    if got == into.nbytes and (body.read(1) if direct is None else direct.read(1)):
        got += 1  # longer than the range asked for: the caller reports it
    return got
