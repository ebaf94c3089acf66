"""CheckpointManager against both storages, in a one-rank gloo world in this process:
round trip, fallback past corrupt or uncommitted checkpoints, retention."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastrain_trainer.checkpoint import CheckpointManager, CheckpointStorage, SaveRequest
from elastrain_trainer.checkpoint import manifest as mf

pytestmark = pytest.mark.usefixtures("one_rank_group")


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "trainer": {"step": seed, "note": f"seed {seed}"}}


def empty_state() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)},
            "trainer": {"step": -1, "note": ""}}


def save_steps(manager: CheckpointManager, *steps: int) -> None:
    for step in steps:
        manager.save(SaveRequest(step, make_state(step), {"step": step}))
    assert manager.wait()


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
    assert mf.classify_keys(storage.list()) == mf.Listing(committed=(4, 6), uncommitted=())


def test_explicit_resume_from_loads_that_checkpoint(storage: CheckpointStorage) -> None:
    manager = CheckpointManager(storage, keep=3, async_save=False)
    save_steps(manager, 1, 2)
    state = empty_state()
    loaded = manager.load(state, resume_from=storage.uri + "/step-00000001")
    assert loaded is not None and loaded.step == 1
    assert state["trainer"]["step"] == 1
