"""CheckpointManager against every storage backend, in a one-rank gloo world in this process:
round trip, fallback past damaged or uncommitted checkpoints (told, quarantined, kept),
directories never overwritten, retention in commit order, `latest` always valid."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from elastrain_trainer.checkpoint import CheckpointManager, CheckpointStorage, SaveRequest
from elastrain_trainer.checkpoint import catalog as cat
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.root import scan

pytestmark = pytest.mark.usefixtures("one_rank_group")


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "trainer": {"step": seed, "note": f"seed {seed}"}}


def empty_state() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
            "trainer": {"step": -1, "note": ""}}


def save_steps(manager: CheckpointManager, *steps: int, seed: int = 0) -> None:
    for step in steps:
        manager.save(SaveRequest(step, make_state(step + seed), {"step": step}))
        assert manager.wait()
        assert_latest_is_the_newest_commit(manager.storage)


def assert_latest_is_the_newest_commit(storage: CheckpointStorage) -> None:
    """`latest` names a committed, undamaged directory that exists: the newest commit."""
    catalog = scan(storage)
    if catalog.newest is None:
        assert not storage.exists(mf.LATEST)
        return
    latest = storage.read(mf.LATEST).decode()
    assert latest == catalog.newest.dir, (latest, catalog)
    assert mf.COMMIT_MARKER in catalog.objects[latest] and latest not in catalog.damaged


def commits(storage: CheckpointStorage) -> list[tuple[str, int]]:
    return [(c.dir, c.step) for c in scan(storage).commits]


def shard_of(storage: CheckpointStorage, d: str) -> str:
    return next(k for k in storage.list(d + "/") if k.endswith(".distcp"))


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_is_exact_and_latest_points_at_the_commit(
        storage: CheckpointStorage, async_save: bool) -> None:
    manager = CheckpointManager(storage, keep=3, async_save=async_save)
    save_steps(manager, 5)
    state = empty_state()
    loaded = manager.load(state)
    assert loaded is not None and loaded.step == 5 and loaded.sidecar == {"step": 5}
    assert torch.equal(state["model"]["w"], make_state(5)["model"]["w"])
    assert state["trainer"] == {"step": 5, "note": "seed 5"}
    assert storage.read(mf.LATEST) == b"step-00000005"


def test_corrupt_shard_falls_back_to_the_previous_commit(
        storage: CheckpointStorage, capsys: pytest.CaptureFixture[str]) -> None:
    manager = CheckpointManager(storage, keep=3, async_save=False)
    save_steps(manager, 1, 2)
    shard = next(k for k in storage.list("step-00000002/") if k.endswith(".distcp"))
    data = bytearray(storage.read(shard))
    data[len(data) // 2] ^= 0xFF
    storage.write(shard, data)
    state = empty_state()
    loaded = manager.load(state)
    assert loaded is not None and loaded.step == 1
    assert torch.equal(state["model"]["w"], make_state(1)["model"]["w"])
    assert "sha256" in capsys.readouterr().out  # the skip is logged with its reason


def test_checkpoint_without_commit_marker_is_never_loaded(storage: CheckpointStorage) -> None:
    manager = CheckpointManager(storage, keep=3, async_save=False)
    save_steps(manager, 1, 2)
    storage.delete(["step-00000002/" + mf.COMMIT_MARKER])
    loaded = manager.load(empty_state())
    assert loaded is not None and loaded.step == 1


def test_no_committed_checkpoint_means_fresh_start(storage: CheckpointStorage) -> None:
    storage.write("step-00000009/__0_0.distcp", b"partial upload")
    assert CheckpointManager(storage, async_save=False).load(empty_state()) is None


def test_retention_keeps_newest_and_removes_abandoned(storage: CheckpointStorage) -> None:
    storage.write("step-00000003/__0_0.distcp", b"abandoned partial save")
    manager = CheckpointManager(storage, keep=2, async_save=False)
    save_steps(manager, 2, 4, 6)
    assert commits(storage) == [("step-00000004", 4), ("step-00000006", 6)]
    assert scan(storage).uncommitted == ()


def test_explicit_resume_from_loads_that_checkpoint(storage: CheckpointStorage) -> None:
    manager = CheckpointManager(storage, keep=3, async_save=False)
    save_steps(manager, 1, 2)
    state = empty_state()
    loaded = manager.load(state, resume_from=storage.uri + "/step-00000001")
    assert loaded is not None and loaded.step == 1
    assert state["trainer"]["step"] == 1


def flip_a_byte(storage: CheckpointStorage, key: str) -> None:
    data = bytearray(storage.read(key))
    data[len(data) // 2] ^= 0xFF
    storage.write(key, data)


DAMAGE = {
    "flipped byte": lambda s, d: flip_a_byte(s, shard_of(s, d)),
    "truncated shard": lambda s, d: s.write(shard_of(s, d), s.read(shard_of(s, d))[:-100]),
    "missing .metadata": lambda s, d: s.delete([f"{d}/.metadata"]),
    "garbage manifest": lambda s, d: s.write(f"{d}/{mf.MANIFEST}", b"{not json"),
    "garbage marker": lambda s, d: s.write(f"{d}/{mf.COMMIT_MARKER}", b"\x00garbage"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damage_is_skipped_told_quarantined_and_kept(storage: CheckpointStorage,
                                                      damage: str) -> None:
    manager = CheckpointManager(storage, keep=3, async_save=False)
    save_steps(manager, 4, 8)
    DAMAGE[damage](storage, "step-00000008")
    resumed = CheckpointManager(storage, keep=3, async_save=False)
    state = empty_state()
    loaded = resumed.load(state)
    assert loaded is not None and loaded.step == 4
    assert torch.equal(state["model"]["w"], make_state(4)["model"]["w"])
    (skipped,) = resumed.skipped
    assert (skipped.step, skipped.uri, skipped.quarantined) == (
        8, f"{storage.uri}/step-00000008", True)
    assert skipped.reason
    # Kept for a post-mortem, marked, and `latest` no longer names it.
    assert storage.exists(f"step-00000008/{mf.QUARANTINED}")
    assert "step-00000008" in scan(storage).damaged
    assert_latest_is_the_newest_commit(storage)
    # Never loaded (or reported) again.
    again = CheckpointManager(storage, keep=3, async_save=False)
    loaded = again.load(empty_state())
    assert loaded is not None and loaded.step == 4 and again.skipped == []


def test_nothing_committed_is_overwritten_after_a_fallback(storage: CheckpointStorage) -> None:
    first = CheckpointManager(storage, keep=2, async_save=False)
    save_steps(first, 4, 8, 12)
    flip_a_byte(storage, shard_of(storage, "step-00000012"))
    damaged = {k: storage.read(k) for k in storage.list("step-00000012/")}
    second = CheckpointManager(storage, keep=2, async_save=False)
    loaded = second.load(empty_state())
    assert loaded is not None and loaded.step == 8
    # The same step numbers come round again, with other values.
    save_steps(second, 12, 16, seed=100)
    assert commits(storage) == [("step-00000012.2", 12), ("step-00000016", 16)]
    # The damaged checkpoint is untouched (retention and the new save of step 12 left it).
    for key, data in damaged.items():
        assert storage.read(key) == data, key
    assert "step-00000012" in scan(storage).damaged
    # The newest work is what resumes.
    state = empty_state()
    loaded = CheckpointManager(storage, async_save=False).load(state)
    assert loaded is not None and loaded.step == 16
    assert torch.equal(state["model"]["w"], make_state(116)["model"]["w"])


def test_a_save_without_a_load_never_writes_into_a_committed_directory(
        storage: CheckpointStorage) -> None:
    save_steps(CheckpointManager(storage, keep=3, async_save=False), 4)
    before = {k: storage.read(k) for k in storage.list("step-00000004/")}
    save_steps(CheckpointManager(storage, keep=3, async_save=False), 4, seed=7)
    assert {k: storage.read(k) for k in storage.list("step-00000004/")} == before
    assert commits(storage) == [("step-00000004", 4), ("step-00000004.2", 4)]
    state = empty_state()
    assert CheckpointManager(storage, async_save=False).load(state) is not None
    assert torch.equal(state["model"]["w"], make_state(11)["model"]["w"])


def test_when_every_commit_is_damaged_the_start_over_is_told(
        storage: CheckpointStorage) -> None:
    save_steps(CheckpointManager(storage, keep=3, async_save=False), 4)
    flip_a_byte(storage, shard_of(storage, "step-00000004"))
    manager = CheckpointManager(storage, async_save=False)
    assert manager.load(empty_state()) is None
    assert [s.step for s in manager.skipped] == [4]
    assert not storage.exists(mf.LATEST)
    assert_latest_is_the_newest_commit(storage)


def test_a_run_told_to_start_over_resumes_only_its_own_commits(
        storage: CheckpointStorage) -> None:
    save_steps(CheckpointManager(storage, keep=5, async_save=False, run="old"), 4, 8, 12)
    fresh = CheckpointManager(storage, keep=5, async_save=False, run="new")
    assert fresh.load(empty_state(), run="new") is None
    save_steps(fresh, 4, seed=50)
    assert commits(storage)[-1] == ("step-00000004.2", 4)
    # Restarted: its own step 4, not the older run's 12.
    state = empty_state()
    loaded = CheckpointManager(storage, async_save=False, run="new").load(state, run="new")
    assert loaded is not None and loaded.uri.endswith("step-00000004.2")
    assert torch.equal(state["model"]["w"], make_state(54)["model"]["w"])
    assert cat.resume_candidates(scan(storage))[0].dir == "step-00000004.2"


def test_checkpoints_written_before_commit_order_still_load_and_order_by_step(
        storage: CheckpointStorage) -> None:
    save_steps(CheckpointManager(storage, keep=5, async_save=False), 4, 8)
    for step in (4, 8):  # the marker as earlier versions wrote it: no sequence, no run
        d = mf.step_dir(step)
        manifest = storage.read(f"{d}/{mf.MANIFEST}")
        storage.write(f"{d}/{mf.COMMIT_MARKER}", json.dumps(
            {"step": step, "manifest_sha256": mf.digest(manifest).sha256}).encode())
    manager = CheckpointManager(storage, keep=5, async_save=False)
    state = empty_state()
    loaded = manager.load(state)
    assert loaded is not None and loaded.step == 8 and manager.skipped == []
    assert torch.equal(state["model"]["w"], make_state(8)["model"]["w"])
    # A new commit comes after every old one, whatever its step.
    save_steps(manager, 6)
    assert [c.step for c in cat.resume_candidates(scan(storage))] == [6, 8, 4]
