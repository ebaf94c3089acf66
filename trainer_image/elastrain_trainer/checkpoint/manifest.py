"""The on-storage layout of checkpoints and the pure rules of commit, resume and retention.

Layout under the root:
    step-00000120/__0_0.distcp ...   shards, written first (DCP)
    step-00000120/.metadata          DCP metadata, written once every shard is written
    step-00000120/manifest.json      size + sha256 of every file above
    step-00000120/sidecar.json       step, epoch, loss, world size, host, hardware, versions
    step-00000120/COMMITTED          written last; names the manifest's sha256
    latest                           "step-00000120", only ever rewritten after a commit
A directory without COMMITTED is in progress or abandoned and is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
SIDECAR = "sidecar.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CorruptCheckpointError(RuntimeError):
    """A committed checkpoint whose bytes do not match its manifest."""


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


def digest(data: bytes | bytearray | memoryview) -> FileDigest:
    view = memoryview(data)
    return FileDigest(size=view.nbytes, sha256=hashlib.sha256(view).hexdigest())


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def build_manifest(step: int, world_size: int, files: dict[str, FileDigest]) -> bytes:
    doc = {"step": step, "world_size": world_size,
           "files": {name: {"size": d.size, "sha256": d.sha256}
                     for name, d in sorted(files.items())}}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def parse_manifest(data: bytes) -> dict[str, FileDigest]:
    doc = json.loads(data)
    return {name: FileDigest(int(f["size"]), str(f["sha256"])) for name, f in doc["files"].items()}


def build_commit_marker(step: int, manifest: bytes) -> bytes:
    return json.dumps({"step": step, "manifest_sha256": digest(manifest).sha256}).encode()


def verify_commit(marker: bytes, manifest: bytes) -> None:
    """Raise CorruptCheckpointError unless the marker vouches for exactly these manifest bytes."""
    expected = json.loads(marker).get("manifest_sha256")
    if expected != digest(manifest).sha256:
        raise CorruptCheckpointError("manifest does not match its commit marker")


def verify_file(name: str, data: bytes | bytearray | memoryview,
                files: dict[str, FileDigest]) -> None:
    expected = files.get(name)
    if expected is None:
        raise CorruptCheckpointError(f"{name} is not in the manifest")
    actual = digest(data)
    if actual != expected:
        raise CorruptCheckpointError(
            f"{name}: sha256 {actual.sha256[:12]} size {actual.size} != manifest "
            f"{expected.sha256[:12]} size {expected.size}")


@dataclass(frozen=True)
class Listing:
    """Checkpoint steps found under a root, split by whether they carry a commit marker."""

    committed: tuple[int, ...]
    uncommitted: tuple[int, ...]


def classify_keys(keys: list[str]) -> Listing:
    """Group storage keys into committed and uncommitted checkpoint steps (ascending)."""
    seen: set[int] = set()
    committed: set[int] = set()
    for key in keys:
        head, _, rest = key.partition("/")
        step = parse_step_dir(head)
        if step is None or not rest:
            continue
        seen.add(step)
        if rest == COMMIT_MARKER:
            committed.add(step)
    return Listing(tuple(sorted(committed)), tuple(sorted(seen - committed)))


def resume_candidates(listing: Listing) -> list[int]:
    """Committed steps to try, newest first; each is a fallback for the one before it."""
    return sorted(listing.committed, reverse=True)


def plan_retention(listing: Listing, keep: int, writing: int | None = None) -> list[int]:
    """Steps to delete: committed ones beyond the newest `keep`, and uncommitted leftovers
    older than the newest committed step. Never the newest committed, never `writing`.
    """
    keep = max(1, keep)
    doomed = set(listing.committed[:-keep]) if len(listing.committed) > keep else set()
    if listing.committed:
        newest = listing.committed[-1]
        doomed |= {s for s in listing.uncommitted if s < newest}
    doomed.discard(writing if writing is not None else -1)
    return sorted(doomed)


def deletion_order(keys: list[str]) -> list[str]:
    """Commit markers first, so a half-deleted checkpoint never looks committed."""
    return sorted(keys, key=lambda k: (not k.endswith("/" + COMMIT_MARKER), k))


def sidecar_bytes(info: dict[str, Any]) -> bytes:
    return json.dumps(info, indent=1, sort_keys=True, default=str).encode()
