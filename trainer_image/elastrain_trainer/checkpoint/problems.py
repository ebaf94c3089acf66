"""The words a checkpoint storage error is told in: a bounded kind, whether waiting can fix it,
and a reason (see diagnose.py). Each backend explains its own errors in them (the storage's
explain_error, storage.ExplainingStorage), so diagnose.py needs no backend and no backend needs
diagnose.py; file:// errors are OSErrors, explained here.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Final

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
