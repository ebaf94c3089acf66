"""What a checkpoint storage error means, in words a user can act on.

`diagnose()` turns an exception from a CheckpointStorage call into a StorageProblem: a bounded
`kind` (a metric label), whether waiting can fix it, and one line that says what is wrong, then
on which operation and key (bucket and key, or directory), at which endpoint and with which
credentials. The start-up check (precheck.py) and the CheckpointManager's failed saves both
report it in /progress, where the operator reads it into the CheckpointsFailing condition. S3
errors are read by checkpoint.s3 (the only module that knows botocore); fsspec filesystems'
(gs://, az://) by checkpoint.fsspec_storage; file:// errors are OSErrors.
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass
from typing import Final

from elastrain_trainer.checkpoint.storage import CheckpointStorage, join

# The bounded values of `kind`.
CREDENTIALS: Final = "credentials"      # no credentials, or the store rejects them
ACCESS_DENIED: Final = "access_denied"  # credentials the store accepts, without the permission
NO_BUCKET: Final = "no_bucket"          # the bucket (or directory) is missing or elsewhere
UNREACHABLE: Final = "unreachable"      # no answer: refused, reset, timed out, unresolvable
STORE_ERROR: Final = "store_error"      # the store's own trouble: 5xx, full, throttling
OTHER: Final = "other"
KINDS: Final = (CREDENTIALS, ACCESS_DENIED, NO_BUCKET, UNREACHABLE, STORE_ERROR, OTHER)
MAX_MESSAGE = 600


@dataclass(frozen=True)
class Explanation:
    """What a backend makes of one error."""

    kind: str
    permanent: bool  # the store answered and refused: waiting cannot fix it
    reason: str


@dataclass(frozen=True)
class StorageProblem:
    kind: str
    permanent: bool
    message: str


def diagnose(storage: CheckpointStorage, error: BaseException, *, action: str,
             key: str = "") -> StorageProblem:
    """`action` is what was attempted (list, write, read, delete, save) on `key` (under the
    storage's root; the root itself when empty)."""
    where = join(storage.uri, key) if key else storage.uri
    # Loaded only where an fsspec URI was opened; then the storage may be one of its.
    fss = sys.modules.get("elastrain_trainer.checkpoint.fsspec_storage")
    if fss is not None and isinstance(storage, fss.FsspecStorage):
        why, context = fss.explain(error), fss.describe_access(storage)
    elif storage.uri.startswith("s3://"):
        from elastrain_trainer.checkpoint import s3  # boto3 only where s3:// is used

        if isinstance(storage, s3.S3Storage):
            why, context = s3.explain(storage, error, action), s3.describe_access(storage)
        else:
            why, context = explain_os_error(error), "custom storage"
    else:
        why, context = explain_os_error(error), f"as uid {os.getuid()}"
    # The reason first: the launcher's one-line crash reason keeps only its beginning.
    message = f"{why.reason} (on {action} {where}; {context})"
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return StorageProblem(why.kind, why.permanent, message)


def unusable(storage_uri: str, error: ValueError) -> StorageProblem:
    """A location that cannot even be opened (a malformed URI or endpoint)."""
    return StorageProblem(OTHER, True, f"{error} (on open {storage_uri})")


_OS_REFUSALS = {
    errno.EACCES: (ACCESS_DENIED, "permission denied"),
    errno.EPERM: (ACCESS_DENIED, "operation not permitted"),
    errno.EROFS: (ACCESS_DENIED, "read-only file system"),
    errno.ENOTDIR: (NO_BUCKET, "a part of the path is not a directory"),
    errno.EISDIR: (NO_BUCKET, "a directory is in the way"),
}
_OS_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def explain_os_error(error: BaseException) -> Explanation:
    """file:// storage: refusals are permanent; a full disk or a flaky mount may recover."""
    if not isinstance(error, OSError):
        return Explanation(OTHER, False, f"{type(error).__name__}: {error}")
    # The errno's name, not its text: "Connection reset by peer" would read like a lost peer.
    name = errno.errorcode.get(error.errno or 0)
    text = f"{type(error).__name__} {name}" if name else f"{type(error).__name__}: {error}"
    if error.errno in _OS_REFUSALS:
        kind, what = _OS_REFUSALS[error.errno]
        return Explanation(kind, True, f"{what} ({text})")
    if error.errno in _OS_FULL:
        return Explanation(STORE_ERROR, False, f"no space left ({text})")
    # EIO, ESTALE, ETIMEDOUT, ENOTCONN...: a network file system that may come back.
    return Explanation(UNREACHABLE, False, text)
