"""The fsspec checkpoint backend: which backend a scheme opens, the message when the image lacks
the package a scheme needs (instead of an ImportError), and what its errors mean."""

from __future__ import annotations

import errno
import importlib.util
from pathlib import Path
from typing import Any

import fsspec
import pytest

from elastrain_trainer.checkpoint import open_storage
from elastrain_trainer.checkpoint.diagnose import diagnose
from elastrain_trainer.checkpoint.fsspec_storage import (
    SCHEMES,
    FsspecStorage,
    MissingBackendError,
    explain,
)
from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.precheck import check_location, probe
from elastrain_trainer.checkpoint.s3 import S3Storage

PACKAGES = sorted({package for package, _extra in SCHEMES.values()})


@pytest.fixture
def no_object_store_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in the default trainer image: neither gcsfs nor adlfs is installed."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name.partition(".")[0] in PACKAGES else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_file_and_s3_keep_their_own_backends(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert isinstance(open_storage("s3://bucket/p", "http://127.0.0.1:9"), S3Storage)


@pytest.mark.parametrize(("uri", "package", "extra"), [
    ("gs://bucket/run", "gcsfs", "gcs"), ("az://ckpts/run", "adlfs", "azure"),
    ("abfs://ckpts/run", "adlfs", "azure")])
@pytest.mark.usefixtures("no_object_store_packages")
def test_a_missing_package_is_named_not_an_import_error(uri: str, package: str,
                                                        extra: str) -> None:
    with pytest.raises(MissingBackendError) as err:
        open_storage(uri)
    assert isinstance(err.value, ValueError) and err.value.__cause__ is None
    assert str(err.value).startswith(f"{uri.partition(':')[0]}:// checkpoints need the Python "
                                      f"package {package}, which this trainer image does not "
                                      f"have")
    assert f"elastrain[{extra}]" in str(err.value)


@pytest.mark.usefixtures("no_object_store_packages")
def test_the_start_up_check_refuses_at_once_naming_the_package() -> None:
    problem = check_location("gs://bucket/run")
    assert problem is not None and problem.permanent and problem.kind == "other"
    assert "need the Python package gcsfs" in problem.message
    assert "ImportError" not in problem.message and "(on open gs://bucket/run)" in problem.message


def test_an_unknown_scheme_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="must start with one of file://, s3://, gs://, az://"):
        open_storage("ftp://host/run")


def test_the_endpoint_goes_only_where_the_filesystem_takes_it() -> None:
    with pytest.raises(ValueError, match="ELASTRAIN_CHECKPOINT_ENDPOINT is not used for az://"):
        FsspecStorage("az://ckpts/run", "http://127.0.0.1:9")


def test_the_start_up_probe_passes_over_an_fsspec_filesystem() -> None:
    storage = FsspecStorage("memory://probe-ok", fs=fsspec.filesystem("memory"))
    assert probe(storage, "host-1") is None
    assert storage.list() == []


@pytest.mark.parametrize(("error", "kind", "permanent", "says"), [
    (PermissionError(errno.EACCES, "Access Denied"), "access_denied", True, "access denied"),
    (OSError("Forbidden: https://storage.googleapis.com/b/o"), "access_denied", True,
     "access denied"),
    (FileNotFoundError(errno.ENOENT, "The specified bucket does not exist"), "no_bucket", True,
     "the bucket or container does not exist"),
    (type("DefaultCredentialsError", (Exception,), {})("no ADC"), "credentials", True,
     "DefaultCredentialsError: no ADC"),
    (ConnectionResetError(errno.ECONNRESET, "reset"), "unreachable", False, "ECONNRESET"),
    (TimeoutError(errno.ETIMEDOUT, "timed out"), "unreachable", False, "ETIMEDOUT"),
])
def test_fsspec_errors_mean_what_the_user_must_fix(error: BaseException, kind: str,
                                                   permanent: bool, says: str) -> None:
    why = explain(error)
    assert (why.kind, why.permanent) == (kind, permanent)
    assert says in why.reason


def test_diagnose_names_the_filesystem_and_the_key() -> None:
    storage = FsspecStorage("memory://ckpts/jobs/demo", fs=fsspec.filesystem("memory"))
    problem = diagnose(storage, PermissionError(errno.EACCES, "denied"), action="write",
                       key="step-00000001/__0_0.distcp")
    assert problem.kind == "access_denied" and problem.permanent
    assert problem.message.startswith("access denied (PermissionError: ")
    assert ("(on write memory://ckpts/jobs/demo/step-00000001/__0_0.distcp; fsspec "
            "fsspec.implementations.memory.MemoryFileSystem, credentials from its default "
            "chain)") in problem.message
