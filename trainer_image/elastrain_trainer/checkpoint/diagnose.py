"""What a checkpoint storage error means, in words a user can act on.

`diagnose()` turns an exception from a CheckpointStorage call into a StorageProblem: a bounded
`kind` (a metric label), whether waiting can fix it, and one line that says what is wrong, then
on which operation and key (bucket and key, or directory), at which endpoint and with which
credentials. The start-up check (precheck.py) and the CheckpointManager's failed saves both
report it in /progress, where the operator reads it into the CheckpointsFailing condition. S3
errors are read by checkpoint.s3 (the only module that knows botocore); fsspec filesystems'
(gs://, az://) by checkpoint.fsspec_storage; file:// errors are OSErrors. Each backend's storage
says it (storage.ExplainingStorage), so this module imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastrain_trainer.checkpoint.problems import MAX_MESSAGE, OTHER, explain_os_error
from elastrain_trainer.checkpoint.storage import CheckpointStorage, ExplainingStorage, join


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
    if isinstance(storage, ExplainingStorage):
        why, context = storage.explain_error(error, action), storage.describe_access()
    else:  # a storage of the user's own: its errors are read as OSErrors
        why, context = explain_os_error(error), "custom storage"
    # The reason first: the launcher's one-line crash reason keeps only its beginning.
    message = f"{why.reason} (on {action} {where}; {context})"
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return StorageProblem(why.kind, why.permanent, message)


def unusable(storage_uri: str, error: ValueError) -> StorageProblem:
    """A location that cannot even be opened (a malformed URI or endpoint)."""
    return StorageProblem(OTHER, True, f"{error} (on open {storage_uri})")
