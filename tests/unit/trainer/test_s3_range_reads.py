"""read_ranges' body reading without a server: bytes go from the socket-level reader straight
into the caller's memory, a body that ends early is fetched again, and a longer one is
refused. (The real MinIO path is tests/integration/trainer/test_s3_streaming.py.)"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from elastrain_trainer.checkpoint.s3_transfer import RANGE_ATTEMPTS, ShortReadError, read_ranges
from elastrain_trainer.checkpoint.storage import ObjectSizeError

DATA = bytes(range(256)) * 64  # 16 KiB


class SocketLevel(io.RawIOBase):
    """Stands in for http.client's response under urllib3's: readinto() fills the buffer."""

    def __init__(self, data: bytes, cut: int | None = None) -> None:
        self._stream = io.BytesIO(data[:cut] if cut is not None else data)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        return self._stream.readinto(b)


class Urllib3Like:
    """urllib3's response: its own read() must not be used when _fp can read into memory."""

    def __init__(self, fp: SocketLevel) -> None:
        self._fp = fp

    def read(self, amt: int | None = None) -> bytes:
        raise AssertionError("read through urllib3's copying read()")

    readinto = read


class Body:
    def __init__(self, data: bytes, cut: int | None = None) -> None:
        self._raw_stream = Urllib3Like(SocketLevel(data, cut))

    def read(self, amt: int | None = None) -> bytes:
        raise AssertionError("read through botocore's copying read()")

    def close(self) -> None:
        pass


class Client:
    """get_object with Range over DATA; the first `short` answers end early."""

    def __init__(self, data: bytes = DATA, short: int = 0, extra: bytes = b"") -> None:
        self.data, self.short, self.extra, self.calls = data, short, extra, 0

    def get_object(self, *, Bucket: str, Key: str, Range: str) -> dict[str, Any]:
        self.calls += 1
        start, end = (int(x) for x in Range.removeprefix("bytes=").split("-"))
        part = self.data[start:end + 1] + self.extra
        cut = len(part) // 2 if self.short > 0 else None
        self.short -= 1
        return {"Body": Body(part, cut), "ContentRange": f"bytes {start}-{end}/{len(self.data)}"}


def read(client: Client, part_bytes: int = 4096) -> bytearray:
    into = bytearray(len(DATA))
    with ThreadPoolExecutor(4) as pool:
        read_ranges(client, "b", "k", memoryview(into), pool, part_bytes=part_bytes)
    return into


def test_ranges_are_read_straight_into_the_callers_memory() -> None:
    client = Client()
    assert read(client) == DATA
    assert client.calls == len(DATA) // 4096


def test_a_body_that_ends_early_is_fetched_again() -> None:
    client = Client(short=1)
    assert read(client, part_bytes=len(DATA)) == DATA
    assert client.calls == 2


def test_a_range_that_keeps_ending_early_fails_naming_the_bytes() -> None:
    # The object is the size expected (Content-Range says so): the connection's fault, retried
    # by the load (a ConnectionError), never taken as proof that the checkpoint is damaged.
    with pytest.raises(ShortReadError, match="bytes 0-16383 gave 8192 of 16384 bytes"):
        read(Client(short=RANGE_ATTEMPTS), part_bytes=len(DATA))
    assert issubclass(ShortReadError, ConnectionError)


def test_a_body_longer_than_its_range_is_refused() -> None:
    with pytest.raises(ObjectSizeError, match="gave more than the 16384 bytes"):
        read(Client(extra=b"!"), part_bytes=len(DATA))
