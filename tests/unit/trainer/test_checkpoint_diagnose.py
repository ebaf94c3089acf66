"""Checkpoint health in the trainer: what a storage error means (diagnose, s3.explain), and
the failed saves the CheckpointManager counts in /progress and /metrics."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from elastrain_trainer import metrics
from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
from elastrain_trainer.checkpoint.diagnose import diagnose
from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.problems import Explanation, explain_os_error
from elastrain_trainer.checkpoint.s3 import S3Storage

ENDPOINT = "http://127.0.0.1:9"  # nothing is ever sent: the errors below are made by hand


def s3_storage(monkeypatch: pytest.MonkeyPatch) -> S3Storage:
    for k, v in {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY1234", "AWS_SECRET_ACCESS_KEY": "secret",
                 "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    return S3Storage("s3://ckpts/jobs/demo", endpoint_url=ENDPOINT, client=fresh_client())


def fresh_client() -> Any:
    """A client of a new session: boto3's default session keeps the first credentials found."""
    return boto3.session.Session().client("s3", endpoint_url=ENDPOINT, region_name="us-east-1")


def client_error(code: str, status: int, operation: str = "PutObject") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"{code} said the store"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, operation)


@pytest.mark.parametrize(("error", "action", "kind", "permanent", "says"), [
    (client_error("SignatureDoesNotMatch", 403), "write", "credentials", True,
     "SignatureDoesNotMatch: the secret access key does not match the access key"),
    (client_error("InvalidAccessKeyId", 403), "list", "credentials", True,
     "the store does not know the access key"),
    (client_error("NoSuchBucket", 404), "list", "no_bucket", True,
     "bucket 'ckpts' does not exist at this endpoint"),
    (client_error("AccessDenied", 403), "delete", "access_denied", True, "grant s3:DeleteObject"),
    (client_error("Forbidden", 403), "write", "access_denied", True, "grant s3:PutObject"),
    (client_error("SlowDown", 503), "write", "store_error", False, "throttles"),
    (client_error("XMinioStorageFull", 507), "write", "store_error", False, "out of space"),
    (client_error("InternalError", 500), "write", "store_error", False, "the store failed"),
    (EndpointConnectionError(endpoint_url=ENDPOINT), "list", "unreachable", False,
     "no answer from the endpoint"),
    (NoCredentialsError(), "list", "credentials", True, "Unable to locate credentials"),
])
def test_s3_errors_say_what_failed_where_and_with_which_credentials(
        monkeypatch: pytest.MonkeyPatch, error: BaseException, action: str, kind: str,
        permanent: bool, says: str) -> None:
    problem = diagnose(s3_storage(monkeypatch), error, action=action, key=".elastrain-check/x")
    assert (problem.kind, problem.permanent) == (kind, permanent)
    # What is wrong first, then where and who; never the secret, and the access key masked.
    reason, _, where = problem.message.partition(" (on ")
    assert says in reason
    assert where == (f"{action} s3://ckpts/jobs/demo/.elastrain-check/x; endpoint {ENDPOINT}, "
                     "access key ****1234 from environment variables "
                     "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
    assert "AKIAEXAMPLE" not in problem.message and "secret'" not in problem.message


def test_s3_without_any_credentials_says_where_it_looked(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    storage = S3Storage("s3://ckpts/p", endpoint_url=ENDPOINT, client=fresh_client())
    problem = diagnose(storage, NoCredentialsError(), action="list")
    assert problem.kind == "credentials" and problem.permanent
    assert "no credentials found: looked in AWS_ACCESS_KEY_ID" in problem.message


@pytest.mark.parametrize(("code", "kind", "permanent"), [
    (errno.EACCES, "access_denied", True), (errno.EROFS, "access_denied", True),
    (errno.ENOTDIR, "no_bucket", True), (errno.ENOSPC, "store_error", False),
    (errno.ECONNRESET, "unreachable", False), (errno.EIO, "unreachable", False),
])
def test_file_errors_refuse_or_may_recover(code: int, kind: str, permanent: bool) -> None:
    why = explain_os_error(OSError(code, "strerror text"))
    assert (why.kind, why.permanent) == (kind, permanent)
    # Never the errno's text: "Connection reset by peer" reads like a lost training peer.
    assert "strerror text" not in why.reason and errno.errorcode[code] in why.reason


def test_each_backend_tells_its_own_errors_and_a_users_storage_reads_as_os_errors(
        tmp_path: Path) -> None:
    class Mine:  # a storage of the user's own: the protocol's methods, no explain_error
        uri = "mem://ckpt"

        def write(self, key: str, data: bytes | bytearray | memoryview) -> None: ...
        def read(self, key: str) -> bytes: return b""
        def exists(self, key: str) -> bool: return False
        def list(self, prefix: str = "") -> list[str]: return []
        def delete(self, keys: Any) -> None: ...

    problem = diagnose(Mine(), OSError(errno.EACCES, "x"), action="write", key="k")  # type: ignore[arg-type]
    assert problem.kind == "access_denied" and problem.permanent
    assert problem.message.endswith("(on write mem://ckpt/k; custom storage)"), problem.message

    class Told(LocalStorage):  # a backend's own reading wins over the OSError's
        def explain_error(self, error: BaseException, action: str) -> Explanation:
            return Explanation("store_error", False, f"told: {action}")

        def describe_access(self) -> str:
            return "by hand"

    problem = diagnose(Told(tmp_path), OSError(errno.EACCES, "x"), action="read")
    assert (problem.kind, problem.permanent) == ("store_error", False)
    assert problem.message == f"told: read (on read file://{tmp_path}; by hand)"


def test_failed_saves_count_until_one_commits(tmp_path: Path) -> None:
    class Full(LocalStorage):
        full = True

        def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(key, data)

    storage = Full(tmp_path / "ckpt")
    manager = CheckpointManager(storage, async_save=False)
    metrics.record_checkpoint_healthy()
    for step in (1, 2):
        manager.save(SaveRequest(step, {"w": torch.zeros(2)}))
    assert health()["consecutiveFailures"] == 2
    assert health()["lastError"] == (f"no space left (OSError ENOSPC) (on save file://{tmp_path}"
                                     "/ckpt/step-00000002; as uid " f"{os.getuid()})")
    assert metrics.CHECKPOINT_FAILURES.labels(kind="store_error")._value.get() >= 2
    storage.full = False
    manager.save(SaveRequest(3, {"w": torch.zeros(2)}))
    assert health()["consecutiveFailures"] == 0
    assert metrics.progress_document()["lastCheckpoint"]["step"] == 3
    assert metrics.CONSECUTIVE_FAILURES._value.get() == 0


def health() -> dict[str, Any]:
    doc = metrics.progress_document()["checkpointHealth"]
    assert doc is not None
    return dict(doc)
