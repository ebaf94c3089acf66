"""Checkpoint storage over fsspec: gs:// (gcsfs), az:// and abfs:// (adlfs), or any fsspec
filesystem handed in (tests run the contract suite over fsspec's memory and local filesystems,
and over s3fs against MinIO).

s3:// stays on boto3 (s3.py) by default; file:// on local.py. Credentials come from each
package's default chain: gcsfs uses Google's application default credentials, so GKE Workload
Identity works without a FUSE sidecar; adlfs reads its AZURE_STORAGE_* variables (account name
and a key, SAS token, connection string or service principal). Other options reach the
filesystem through fsspec's own environment variables, e.g. FSSPEC_GS_PROJECT=my-project
(spec.env).

A write is one object PUT (`pipe_file`), which object stores make visible only once complete;
on a local filesystem it goes to a temporary sibling renamed into place. Listing caches are off:
another rank or process may have written `latest` since this one last listed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import uuid
from collections.abc import Iterable
from typing import Any

import fsspec

from elastrain_trainer.checkpoint.problems import (
    ACCESS_DENIED,
    CREDENTIALS,
    NO_BUCKET,
    Explanation,
    explain_os_error,
)

# Scheme -> (the Python package implementing it, the pip extra that installs it).
SCHEMES: dict[str, tuple[str, str]] = {
    "gs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
}
# Schemes whose filesystem takes spec.checkpoint.endpoint, and under which argument.
_ENDPOINT_ARG = {"s3": "endpoint_url", "gs": "endpoint_url"}
_TMP_MARK = ".elastrain-tmp-"


class MissingBackendError(ValueError):
    """The image lacks the package a scheme needs (a user error: the message says what to do)."""


def scheme_of(uri: str) -> str:
    return uri.partition("://")[0] if "://" in uri else ""


def require_backend(uri: str) -> None:
    """Raise MissingBackendError naming the package when this image cannot open `uri`."""
    scheme = scheme_of(uri)
    if scheme not in SCHEMES:
        return
    package, extra = SCHEMES[scheme]
    if importlib.util.find_spec(package) is None:
        raise MissingBackendError(
            f"{scheme}:// checkpoints need the Python package {package}, which this trainer "
            f"image does not have: build the image with it (pip install {package}, or the "
            f"elastrain[{extra}] extra)")


class FsspecStorage:
    """Keys live under the root path of an fsspec filesystem."""

    def __init__(self, uri: str, endpoint: str = "", fs: Any | None = None,
                 **options: Any) -> None:
        if fs is None:
            if endpoint:
                arg = _ENDPOINT_ARG.get(scheme_of(uri))
                if arg is None:
                    raise ValueError(f"ELASTRAIN_CHECKPOINT_ENDPOINT is not used for "
                                     f"{scheme_of(uri)}:// (set the filesystem's own options)")
                options[arg] = endpoint
            require_backend(uri)
            options.setdefault("use_listings_cache", False)
            try:
                fs, _ = fsspec.core.url_to_fs(uri, **options)
            except ImportError as e:  # installed but broken, or a scheme not in SCHEMES
                raise MissingBackendError(f"{uri}: cannot load its fsspec filesystem: {e}") from e
        self.fs = fs
        self.root = fsspec.core.strip_protocol(uri).rstrip("/")
        self._scheme = scheme_of(uri) or "file"
        self._local = "file" in _protocols(fs)

    @property
    def uri(self) -> str:
        return f"{self._scheme}://{self.root.lstrip('/') if self._scheme != 'file' else self.root}"

    def explain_error(self, error: BaseException, action: str) -> Explanation:
        return explain(error)

    def describe_access(self) -> str:
        return describe_access(self)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        path = self._path(key)
        if not self._local:
            self.fs.pipe_file(path, bytes(data))
            return
        parent = path.rpartition("/")[0]
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/{_TMP_MARK}{uuid.uuid4().hex}"
        try:
            self.fs.pipe_file(tmp, bytes(data))
            self.fs.mv(tmp, path)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm_file(tmp)
            raise

    def read(self, key: str) -> bytes:
        data: bytes = self.fs.cat_file(self._path(key))
        return data

    def exists(self, key: str) -> bool:
        return bool(self.fs.isfile(self._path(key)))

    def list(self, prefix: str = "") -> list[str]:
        # Only the folder the prefix names is listed, not the whole root.
        base = self._path(prefix.rpartition("/")[0]).rstrip("/")
        root = f"{self.root}/" if self.root else ""
        try:
            found = self.fs.find(base) if base else self.fs.find("")
        except FileNotFoundError:
            return []
        keys = [str(p)[len(root):] for p in found if str(p).startswith(root)]
        return sorted(k for k in keys if k.startswith(prefix)
                      and not k.rpartition("/")[2].startswith(_TMP_MARK))

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]
        if not paths:
            return
        try:
            self.fs.rm(paths)  # one batched request on object stores
        except FileNotFoundError:
            for path in paths:  # some were missing: remove the rest one by one
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


# --- what an error means (checkpoint.diagnose) ------------------------------------------------
def explain(error: BaseException) -> Explanation:
    """fsspec filesystems raise OSErrors (s3fs, adlfs and gcsfs translate their services'
    refusals into PermissionError and FileNotFoundError) or their auth library's own errors."""
    if "Credential" in type(error).__name__ or "RefreshError" in type(error).__name__:
        # google.auth's DefaultCredentialsError/RefreshError, azure-identity's, botocore's.
        return Explanation(CREDENTIALS, True, f"{type(error).__name__}: {error}")
    if isinstance(error, FileNotFoundError):
        return Explanation(NO_BUCKET, True, f"the bucket or container does not exist "
                                            f"({type(error).__name__}: {error})")
    if isinstance(error, PermissionError) or str(error).startswith(("Forbidden", "Unauthorized")):
        return Explanation(ACCESS_DENIED, True, f"access denied ({type(error).__name__}: "
                                                f"{error})")
    return explain_os_error(error)


def describe_access(storage: FsspecStorage) -> str:
    """The filesystem class and where its credentials come from (never a secret)."""
    cls = type(storage.fs)
    return f"fsspec {cls.__module__}.{cls.__name__}, credentials from its default chain"
