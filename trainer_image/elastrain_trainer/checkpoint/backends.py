"""Which CheckpointStorage backend serves a URI: boto3 is imported only for s3://, fsspec's
filesystems only for theirs."""

from __future__ import annotations

from elastrain_trainer.checkpoint.storage import CheckpointStorage


def open_storage(uri: str, endpoint: str = "") -> CheckpointStorage:
    """The backend for the URI's scheme; MissingBackendError (a ValueError) names a missing
    package."""
    if uri.startswith("file://"):
        from elastrain_trainer.checkpoint.local import LocalStorage

        return LocalStorage(uri.removeprefix("file://"))
    if uri.startswith("s3://"):
        from elastrain_trainer.checkpoint.s3 import S3Storage

        return S3Storage(uri, endpoint_url=endpoint or None)
    from elastrain_trainer.checkpoint.fsspec_storage import SCHEMES, FsspecStorage, scheme_of

    if scheme_of(uri) in SCHEMES:
        return FsspecStorage(uri, endpoint)
    schemes = ", ".join(f"{s}://" for s in ("file", "s3", *SCHEMES))
    raise ValueError(f"ELASTRAIN_CHECKPOINT_URI={uri!r} must start with one of {schemes}")
