"""One contract for every CheckpointStorage backend: file://, boto3 on the real MinIO, and the
fsspec backend over fsspec's memory and local filesystems and over s3fs on the same MinIO."""

from __future__ import annotations

import os

import pytest

from elastrain_trainer.checkpoint import CheckpointStorage


def test_write_then_read_returns_the_same_bytes(storage: CheckpointStorage) -> None:
    storage.write("step-00000001/a.bin", b"hello")
    assert storage.read("step-00000001/a.bin") == b"hello"


def test_large_object_goes_through_multipart_intact(storage: CheckpointStorage) -> None:
    data = os.urandom(40 << 20)  # above the 16 MiB multipart threshold: several parts
    storage.write("big.bin", memoryview(data))
    assert storage.read("big.bin") == data


def test_write_replaces_the_whole_object(storage: CheckpointStorage) -> None:
    storage.write("k", b"x" * 1000)
    storage.write("k", b"short")
    assert storage.read("k") == b"short"


def test_missing_key_raises_file_not_found(storage: CheckpointStorage) -> None:
    with pytest.raises(FileNotFoundError):
        storage.read("nope/missing")
    assert not storage.exists("nope/missing")


def test_list_is_sorted_recursive_and_filtered_by_prefix(storage: CheckpointStorage) -> None:
    for key in ("step-00000002/b", "step-00000001/a", "step-00000001/sub/c", "latest"):
        storage.write(key, b"1")
    assert storage.list() == ["latest", "step-00000001/a", "step-00000001/sub/c",
                              "step-00000002/b"]
    assert storage.list("step-00000001/") == ["step-00000001/a", "step-00000001/sub/c"]
    assert storage.exists("latest")


def test_delete_removes_keys_and_ignores_missing_ones(storage: CheckpointStorage) -> None:
    storage.write("d/1", b"1")
    storage.write("d/2", b"2")
    storage.delete(["d/1", "d/never-existed"])
    assert storage.list() == ["d/2"]


def test_uri_names_the_root(storage: CheckpointStorage) -> None:
    assert storage.uri.startswith(("file:///", "s3://", "memory://"))
    assert not storage.uri.endswith("/")
