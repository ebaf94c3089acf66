"""The s3:// streamed paths against the real MinIO: multipart uploads made while the caller
writes (hashed on the way, nothing visible unless completed) and ranged parallel reads into
preallocated memory; through CheckpointManager, a multipart shard round-trips, a corrupt one
is never loaded, a failed upload never becomes latest, and async saves reusing their staging
buffers save each step's own values."""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any

import boto3
import pytest
import torch

from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.root import scan
from elastrain_trainer.checkpoint.s3 import S3Storage

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("one_rank_group")]
MIB = 1 << 20
PART = 5 * MIB  # S3's smallest part: these tests upload and read several parts per object


class FailingParts:
    """A boto3 client whose UploadPart fails for part `number` (every other call is real)."""

    def __init__(self, client: Any, number: int) -> None:
        self._client, self._number = client, number
        self.fail = True

    def upload_part(self, **kwargs: Any) -> Any:
        if self.fail and kwargs["PartNumber"] == self._number:
            raise ConnectionError("injected: the part upload broke")
        return self._client.upload_part(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.fixture
def storage(s3_credentials: Any) -> Any:
    s3 = s3_credentials
    store = S3Storage(f"s3://{s3.bucket}/trainer-tests/stream-{uuid.uuid4().hex[:10]}",
                      endpoint_url=s3.endpoint_url, part_bytes=PART)
    yield store
    store.delete(store.list())


def open_uploads(storage: S3Storage) -> list[str]:
    found = storage.client.list_multipart_uploads(Bucket=storage.bucket,
                                                  Prefix=storage.prefix + "/")
    return [u["Key"] for u in found.get("Uploads", [])]


def etag(storage: S3Storage, key: str) -> str:
    return str(storage.client.head_object(Bucket=storage.bucket,
                                          Key=f"{storage.prefix}/{key}")["ETag"])


@pytest.mark.parametrize("size", [0, 100, PART, 13 * MIB + 7])
def test_streamed_object_is_what_was_written_with_its_digest(storage: S3Storage,
                                                             size: int) -> None:
    data = os.urandom(size)
    writer = storage.open_writer("obj")
    for i in range(0, size, MIB + 3):  # writes that straddle part boundaries
        writer.write(memoryview(data)[i:i + MIB + 3])
    assert writer.tell() == size
    assert not storage.exists("obj"), "visible before close"
    writer.close()
    assert storage.read("obj") == data
    assert writer.digest == (size, hashlib.sha256(data).hexdigest())
    assert etag(storage, "obj").endswith("-3\"") == (size == 13 * MIB + 7)


def test_an_aborted_stream_leaves_no_object_and_no_upload(storage: S3Storage) -> None:
    writer = storage.open_writer("obj")
    writer.write(os.urandom(12 * MIB))  # two parts already on their way
    writer.abort()
    assert not storage.exists("obj")
    assert open_uploads(storage) == []


def test_a_failed_part_fails_the_stream_and_leaves_no_object(s3_credentials: Any) -> None:
    s3 = s3_credentials
    client = FailingParts(boto3.client("s3", endpoint_url=s3.endpoint_url), number=2)
    store = S3Storage(f"s3://{s3.bucket}/trainer-tests/stream-{uuid.uuid4().hex[:10]}",
                      client=client, part_bytes=PART)
    writer = store.open_writer("obj")
    with pytest.raises(ConnectionError, match="injected"):
        writer.write(os.urandom(16 * MIB))
        writer.close()
    writer.abort()
    assert not store.exists("obj")
    assert open_uploads(store) == []


def test_ranged_read_fills_memory_and_shows_the_bytes_in_order(storage: S3Storage) -> None:
    data = os.urandom(17 * MIB + 5)
    storage.write("obj", data)
    into = bytearray(len(data))
    seen = hashlib.sha256()
    sizes: list[int] = []

    def on_range(view: memoryview) -> None:
        seen.update(view)
        sizes.append(view.nbytes)

    storage.read_into("obj", memoryview(into), on_range)
    assert into == data
    assert seen.hexdigest() == hashlib.sha256(data).hexdigest()
    assert sizes == [PART, PART, PART, 2 * MIB + 5]


def test_ranged_read_of_another_size_or_a_missing_key_fails(storage: S3Storage) -> None:
    storage.write("obj", os.urandom(6 * MIB))
    with pytest.raises(ValueError, match="not the 6291455 expected"):
        storage.read_into("obj", memoryview(bytearray(6 * MIB - 1)))
    with pytest.raises(Exception, match=r"InvalidRange|not the 11534336 expected"):
        storage.read_into("obj", memoryview(bytearray(11 * MIB)))
    with pytest.raises(FileNotFoundError):
        storage.read_into("missing", memoryview(bytearray(10)))


def big_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)  # ~13 MiB: one shard of three parts
    return {"model": {"w": torch.randn(1024, 1024, generator=g),
                      "v": torch.randn(2, 1024, 1024, generator=g)},
            "trainer": {"step": seed}}


def zeros() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(1024, 1024), "v": torch.zeros(2, 1024, 1024)},
            "trainer": {"step": -1}}


def assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["trainer"] == b["trainer"]
    for name in ("w", "v"):
        assert torch.equal(a["model"][name], b["model"][name]), name


def shard_of(storage: S3Storage, step: int) -> str:
    return next(k for k in storage.list(mf.step_dir(step) + "/") if k.endswith(".distcp"))


def test_a_multipart_shard_round_trips_and_a_corrupt_one_is_never_loaded(
        storage: S3Storage) -> None:
    manager = CheckpointManager(storage, keep=3, async_save=False)
    for step in (1, 2):
        manager.save(SaveRequest(step, big_state(step), {"step": step}))
    assert manager.failed_saves == 0
    assert etag(storage, shard_of(storage, 2)).endswith("-3\"")  # streamed in parts
    state = zeros()
    assert CheckpointManager(storage, async_save=False).load(state).step == 2  # type: ignore[union-attr]
    assert_equal(state, big_state(2))

    shard = shard_of(storage, 2)
    data = bytearray(storage.read(shard))
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle part, same size
    storage.write(shard, data)
    state = zeros()
    loaded = CheckpointManager(storage, async_save=False).load(state)
    assert loaded is not None and loaded.step == 1
    assert_equal(state, big_state(1))


def test_a_failed_streamed_save_never_becomes_latest(s3_credentials: Any) -> None:
    s3 = s3_credentials
    client = FailingParts(boto3.client("s3", endpoint_url=s3.endpoint_url), number=2)
    client.fail = False
    store = S3Storage(f"s3://{s3.bucket}/trainer-tests/stream-{uuid.uuid4().hex[:10]}",
                      client=client, part_bytes=PART)
    try:
        manager = CheckpointManager(store, keep=3, async_save=False)
        manager.save(SaveRequest(1, big_state(1), {}))
        client.fail = True
        manager.save(SaveRequest(2, big_state(2), {}))
        assert manager.failed_saves == 1
        assert store.read(mf.LATEST) == mf.step_dir(1).encode()
        assert [c.step for c in scan(store).commits] == [1]
        assert open_uploads(store) == []
        state = zeros()
        assert CheckpointManager(store, async_save=False).load(state).step == 1  # type: ignore[union-attr]
        assert_equal(state, big_state(1))
    finally:
        store.delete(store.list())


def test_async_saves_reusing_staging_buffers_save_each_steps_own_values(
        storage: S3Storage) -> None:
    manager = CheckpointManager(storage, keep=3, async_save=True)
    live = big_state(1)
    for step in (1, 2, 3):
        live["trainer"]["step"] = step
        manager.save(SaveRequest(step, live, {}))
        # Training goes on while the upload is in flight: the saved values must not move.
        for t in live["model"].values():
            t.add_(1.0)
    assert manager.wait() and manager.failed_saves == 0
    manager.close()
    for step in (1, 2, 3):
        state = zeros()
        loaded = CheckpointManager(storage, async_save=False).load(
            state, resume_from=f"{storage.uri}/{mf.step_dir(step)}")
        assert loaded is not None and loaded.step == step
        expected = big_state(1)
        for _ in range(step - 1):  # the same float additions as above, in the same order
            for t in expected["model"].values():
                t.add_(1.0)
        expected["trainer"]["step"] = step
        assert_equal(state, expected)


def test_views_dtypes_and_bytes_load_exactly_from_the_shard_in_memory(
        storage: S3Storage) -> None:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 48, generator=g)
    saved = {"model": {"transposed": base.t(), "narrowed": base[5:20, 3:40],
                       "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
                       "step": torch.tensor(12345, dtype=torch.int64)},
             "trainer": {"note": "bytes too", "nested": [1, 2.5, "x"]}}
    manager = CheckpointManager(storage, keep=1, async_save=False)
    manager.save(SaveRequest(1, saved, {}))
    assert manager.failed_saves == 0
    into = {"model": {"transposed": torch.zeros(48, 64), "narrowed": torch.zeros(15, 37),
                      "bf16": torch.zeros(33, 17, dtype=torch.bfloat16),
                      "step": torch.tensor(0, dtype=torch.int64)},
            "trainer": {"note": "", "nested": []}}
    assert CheckpointManager(storage, async_save=False).load(into) is not None
    assert into["trainer"] == saved["trainer"]
    for name, t in saved["model"].items():
        assert torch.equal(into["model"][name], t), name


def test_parts_are_sent_unsigned_but_with_a_checksum_the_server_verifies(storage: Any) -> None:
    # The SigV4 payload hash would be a second sha256 of every byte over plain http; the CRC32
    # checksum header keeps each part verified by the server instead.
    sent: list[dict[str, str]] = []

    def record(request: Any, **_: Any) -> None:
        if "uploadId=" in request.url and "partNumber=" in request.url:
            sent.append({k.lower(): v.decode() if isinstance(v, bytes) else str(v)
                         for k, v in request.headers.items()})
    storage.client.meta.events.register("before-send.s3.UploadPart", record)
    writer = storage.open_writer("unsigned.bin")
    writer.write(os.urandom(2 * PART + 1))
    writer.close()
    assert len(sent) == 3
    for headers in sent:
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert any(k.startswith("x-amz-checksum-") for k in headers), headers
    # A part whose bytes do not match its checksum is refused by the server.
    bad = storage.client.create_multipart_upload(Bucket=storage.bucket,
                                                 Key=f"{storage.prefix}/bad.bin")
    with pytest.raises(Exception, match=r"(?i)checksum|digest"):
        storage.client.upload_part(Bucket=storage.bucket, Key=f"{storage.prefix}/bad.bin",
                                   UploadId=bad["UploadId"], PartNumber=1, Body=b"x" * 1024,
                                   ChecksumCRC32="AAAAAA==")
    storage.client.abort_multipart_upload(Bucket=storage.bucket,
                                          Key=f"{storage.prefix}/bad.bin",
                                          UploadId=bad["UploadId"])
