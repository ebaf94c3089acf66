"""What a checkpoint root holds, read and marked: its catalog (`scan`: the listing and the
commit markers, catalog.py's rules applied), a commit's checked manifest and sidecar
(`read_committed`), and the QUARANTINED marker of a commit proven damaged. The manager reads
through these; so do the tests and tools that inspect a bucket as the trainers see it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from elastrain_trainer.checkpoint import catalog as cat
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.storage import CheckpointStorage, join
from elastrain_trainer.events import emit


def scan(storage: CheckpointStorage, known: cat.Catalog | None = None) -> cat.Catalog:
    """List the root and read the commit markers (their sequence numbers order the commits)
    and the generation records; those of `known` still listed are taken from it, not read
    again."""
    keys = storage.list()
    objects = cat.group_keys(keys)
    commits = {c.dir: c for c in (*known.commits, *known.generations)} \
        if known is not None else {}
    markers: dict[str, bytes | None] = {}
    for d in cat.marker_dirs(objects, commits):
        try:
            markers[d] = storage.read(join(d, mf.COMMIT_MARKER))
        except FileNotFoundError:
            markers[d] = None  # deleted since the listing
    records: dict[str, bytes | None] = {}
    for key in cat.record_keys(keys, commits):
        try:
            records[key] = storage.read(key)
        except FileNotFoundError:
            records[key] = None  # superseded and deleted since the listing
    return cat.build_catalog(objects, markers, commits,
                             cat.parse_records(records, commits, keys))


def read_committed(storage: CheckpointStorage, key: str,
                   names: Iterable[str]) -> tuple[dict[str, mf.FileDigest], dict[str, Any]]:
    """(manifest files, sidecar) of a committed checkpoint; CorruptCheckpointError when what is
    stored proves it damaged. Other exceptions are the store's."""
    try:
        marker = storage.read(join(key, mf.COMMIT_MARKER))
        manifest = storage.read(join(key, mf.MANIFEST))
        files = mf.parse_checked_manifest(marker, manifest)
        sidecar = json.loads(storage.read(join(key, mf.SIDECAR)))
    except FileNotFoundError as e:
        raise mf.CorruptCheckpointError(f"incomplete: {e}") from None
    except json.JSONDecodeError as e:
        raise mf.CorruptCheckpointError(f"{mf.SIDECAR} is not JSON ({e})") from None
    present = set(names)
    missing = sorted(n for n in files if n not in present)
    if missing:
        raise mf.CorruptCheckpointError(f"{', '.join(missing)} named in the manifest "
                                        f"{'is' if len(missing) == 1 else 'are'} missing")
    return files, sidecar if isinstance(sidecar, dict) else {}


def quarantine(storage: CheckpointStorage, d: str, step: int, reason: str, when: str) -> bool:
    """Mark `d` proven damaged (kept for a post-mortem, never loaded or deleted again);
    False when the marker could not be written."""
    try:
        storage.write(join(d, mf.QUARANTINED), mf.build_quarantine_marker(step, reason, when))
    except Exception as e:  # still never loaded or deleted by this process; told once more later
        emit("checkpoint_quarantine_failed", uri=join(storage.uri, d),
             error=f"{type(e).__name__}: {e}"[:600])
        return False
    return True
