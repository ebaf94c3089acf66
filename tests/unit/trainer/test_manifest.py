from __future__ import annotations

import pytest

from elastrain_trainer.checkpoint import manifest as mf


def keys(*names: str) -> list[str]:
    return list(names)


def test_classify_needs_the_commit_marker() -> None:
    listing = mf.classify_keys(keys(
        "latest", "step-00000002/__0_0.distcp", "step-00000002/COMMITTED",
        "step-00000004/__0_0.distcp", "step-00000003/COMMITTED", "junk/COMMITTED"))
    assert listing == mf.Listing(committed=(2, 3), uncommitted=(4,))
    assert mf.resume_candidates(listing) == [3, 2]


def test_retention_keeps_newest_n_and_drops_abandoned_partials() -> None:
    listing = mf.Listing(committed=(1, 2, 3, 5), uncommitted=(4, 6))
    assert mf.plan_retention(listing, keep=2) == [1, 2, 4]


def test_retention_never_deletes_the_newest_or_the_one_being_written() -> None:
    assert mf.plan_retention(mf.Listing((7,), ()), keep=0) == []
    assert mf.plan_retention(mf.Listing((3, 7), (5,)), keep=1, writing=5) == [3]


def test_markers_are_deleted_first() -> None:
    order = mf.deletion_order(["s/a", "s/COMMITTED", "s/b"])
    assert order[0] == "s/COMMITTED"


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
