from __future__ import annotations

import json

import pytest

from elastrain_trainer.checkpoint import manifest as mf


def keys(*names: str) -> list[str]:
    return list(names)


def test_commit_marker_vouches_for_exact_manifest_bytes() -> None:
    files = {"__0_0.distcp": mf.digest(b"shard")}
    manifest = mf.build_manifest(5, 2, files)
    marker = mf.build_commit_marker(5, manifest)
    mf.verify_commit(marker, manifest)
    assert mf.parse_manifest(manifest) == files
    with pytest.raises(mf.CorruptCheckpointError):
        mf.verify_commit(marker, manifest + b" ")


def test_file_verification_catches_flipped_bytes_and_unknown_files() -> None:
    files = {"a": mf.digest(b"abc")}
    mf.verify_file("a", b"abc", files)
    with pytest.raises(mf.CorruptCheckpointError, match="sha256"):
        mf.verify_file("a", b"abd", files)
    with pytest.raises(mf.CorruptCheckpointError, match="not in the manifest"):
        mf.verify_file("b", b"abc", files)


def test_step_dir_names_round_trip() -> None:
    assert mf.parse_step_dir(mf.step_dir(42)) == 42
    assert mf.parse_step_dir("step-12") is None
    assert mf.parse_dir(mf.step_dir(42, 3)) == (42, 3)
    assert mf.step_dir(42, 3) == "step-00000042.3"
    for name in ("step-00000042.1", "step-00000042.0", "step-00000042.03", "step-00000042."):
        assert mf.parse_dir(name) is None, name


def test_markers_carry_commit_order_and_run_and_old_markers_still_parse() -> None:
    manifest = mf.build_manifest(5, 2, {})
    marker = mf.parse_commit_marker(mf.build_commit_marker(5, manifest, seq=7, run="uid-1"))
    assert (marker.step, marker.seq, marker.run) == (5, 7, "uid-1")
    # Written before commit order existed: no seq, no run.
    old = json.dumps({"step": 5, "manifest_sha256": mf.digest(manifest).sha256}).encode()
    assert mf.parse_commit_marker(old) == mf.Marker(5, mf.digest(manifest).sha256, 0, "")
    mf.verify_commit(old, manifest)
    for garbage in (b"", b"{", b"[]", b'{"step": "x"}', b'{"manifest_sha256": "a"}'):
        with pytest.raises(mf.CorruptCheckpointError, match="not a commit marker"):
            mf.parse_commit_marker(garbage)


def test_a_manifest_that_is_not_one_is_damage() -> None:
    garbage = b'{"files": 3}'
    marker = mf.build_commit_marker(1, garbage)
    with pytest.raises(mf.CorruptCheckpointError, match="not a manifest"):
        mf.parse_checked_manifest(marker, garbage)
