"""The on-storage layout of one checkpoint: file digests, the manifest and the commit marker.

Layout under the root:
    step-00000120/__0_0.distcp ...   shards, written first (DCP)
    step-00000120/.metadata          DCP metadata, written once every shard is written
    step-00000120/manifest.json      size + sha256 of every file above
    step-00000120/sidecar.json       step, epoch, loss, world size, host, hardware, versions
    step-00000120/COMMITTED          written last; names the manifest's sha256, the commit's
                                     sequence number, the run that wrote it and (in-process
                                     mode) the store incarnation and generation it was made in
    step-00000120/QUARANTINED        only on a committed checkpoint proven damaged: why, when
    step-00000120.2/...              a later save of the same step (catalog.choose_dir)
    latest                           the newest commit's directory, rewritten after each commit
A directory without COMMITTED is in progress or abandoned and is never loaded. Which
directories exist, their commit order, resume and retention are catalog.py's rules.
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
QUARANTINED = "QUARANTINED"
# The root's folder of generation records (build_generation_record).
GENERATIONS = "generations"
# step-00000120, or step-00000120.2 for the second directory of that step.
_STEP_DIR = re.compile(r"^step-(\d{8,})(?:\.([2-9]|[1-9]\d+))?$")


class CorruptCheckpointError(RuntimeError):
    """A committed checkpoint whose bytes do not match its manifest."""


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


def digest(data: bytes | bytearray | memoryview) -> FileDigest:
    view = memoryview(data)
    return FileDigest(size=view.nbytes, sha256=hashlib.sha256(view).hexdigest())


def step_dir(step: int, attempt: int = 1) -> str:
    """The directory of a save of `step`; attempt 2, 3... when earlier ones exist."""
    return f"step-{step:08d}" if attempt <= 1 else f"step-{step:08d}.{attempt}"


def parse_dir(name: str) -> tuple[int, int] | None:
    """(step, attempt) of a checkpoint directory name; None for anything else."""
    m = _STEP_DIR.match(name)
    return (int(m.group(1)), int(m.group(2) or 1)) if m else None


def parse_step_dir(name: str) -> int | None:
    parsed = parse_dir(name)
    return parsed[0] if parsed else None


def build_manifest(step: int, world_size: int, files: dict[str, FileDigest]) -> bytes:
    doc = {"step": step, "world_size": world_size,
           "files": {name: {"size": d.size, "sha256": d.sha256}
                     for name, d in sorted(files.items())}}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def parse_manifest(data: bytes) -> dict[str, FileDigest]:
    doc = json.loads(data)
    return {name: FileDigest(int(f["size"]), str(f["sha256"])) for name, f in doc["files"].items()}


@dataclass(frozen=True)
class Marker:
    """What a COMMITTED marker says. `seq` orders commits (0: written before commits carried a
    sequence number; those order by step); `run` is the run that wrote it ("" if unknown);
    `store_epoch` and `gen` the job store's incarnation and the in-process generation whose world
    made it ("" and 0: restart mode, or written before markers carried them; catalog.py's
    fencing rule compares generations of one epoch)."""

    step: int
    manifest_sha256: str
    seq: int = 0
    run: str = ""
    store_epoch: str = ""
    gen: int = 0


def build_commit_marker(step: int, manifest: bytes, seq: int = 0, run: str = "",
                        store_epoch: str = "", gen: int = 0) -> bytes:
    doc: dict[str, Any] = {"step": step, "manifest_sha256": digest(manifest).sha256, "seq": seq,
                           "run": run}
    if gen:
        doc |= {"store_epoch": store_epoch, "gen": gen}
    return json.dumps(doc).encode()


def parse_commit_marker(data: bytes) -> Marker:
    """CorruptCheckpointError for anything but a marker this module wrote (any version)."""
    try:
        doc = json.loads(data)
        return Marker(int(doc["step"]), str(doc["manifest_sha256"]), int(doc.get("seq", 0)),
                      str(doc.get("run", "")), str(doc.get("store_epoch", "")),
                      int(doc.get("gen", 0)))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptCheckpointError(f"{COMMIT_MARKER} is not a commit marker ({e})") from None


def generation_record_key(run: str, lineage: str, gen: int) -> str:
    """Where the record of `run`'s `lineage` entering generation `gen` is written."""
    of = hashlib.sha256(f"{run}\0{lineage}".encode()).hexdigest()[:16]
    return f"{GENERATIONS}/gen-{gen:08d}-{of}"


def build_generation_record(run: str, lineage: str, gen: int, seq: int) -> bytes:
    """A world's word in the bucket that it entered generation `gen` of `lineage` when the
    next commit would be numbered `seq` (catalog.py: it fences like a commit of that
    generation, before the world has committed anything in it)."""
    return json.dumps({"run": run, "store_epoch": lineage, "gen": gen, "seq": seq}).encode()


def parse_generation_record(data: bytes) -> Marker:
    """The record as a Marker of no step (-1); CorruptCheckpointError for anything else."""
    try:
        doc = json.loads(data)
        return Marker(-1, "", int(doc["seq"]), str(doc["run"]), str(doc["store_epoch"]),
                      int(doc["gen"]))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptCheckpointError(f"not a generation record ({e})") from None


def verify_commit(marker: bytes, manifest: bytes) -> None:
    """Raise CorruptCheckpointError unless the marker vouches for exactly these manifest bytes."""
    if parse_commit_marker(marker).manifest_sha256 != digest(manifest).sha256:
        raise CorruptCheckpointError("manifest does not match its commit marker")


def parse_checked_manifest(marker: bytes, manifest: bytes) -> dict[str, FileDigest]:
    """The manifest's files, once the marker vouches for it; CorruptCheckpointError otherwise."""
    verify_commit(marker, manifest)
    try:
        return parse_manifest(manifest)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptCheckpointError(f"{MANIFEST} is not a manifest ({e})") from None


def build_quarantine_marker(step: int, reason: str, time_rfc3339: str) -> bytes:
    return json.dumps({"step": step, "reason": reason, "time": time_rfc3339}).encode()


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


def sidecar_bytes(info: dict[str, Any]) -> bytes:
    return json.dumps(info, indent=1, sort_keys=True, default=str).encode()
