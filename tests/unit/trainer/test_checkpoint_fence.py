"""A commit's fence (in-process mode): a writer the world planned out commits nothing, and every
commit records the generation that made it (catalog.py's rule reads it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastrain_trainer.checkpoint import CheckpointManager, SaveRequest
from elastrain_trainer.checkpoint import manifest as mf
from elastrain_trainer.checkpoint.local import LocalStorage
from elastrain_trainer.checkpoint.root import scan


class FencedError(RuntimeError):
    pass


class World:
    """The store's answer as the fence reads it: this node's generation, or planned out."""

    def __init__(self) -> None:
        self.planned_out = False

    def __call__(self) -> tuple[str, int]:
        if self.planned_out:
            raise FencedError("planned out: generation 4 is the world's, this node's is 3")
        return "epoch-1", 3


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(step))}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_planned_out_writer_commits_nothing_moves_no_latest_and_deletes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], async_save: bool) -> None:
    storage = LocalStorage(tmp_path / "ckpt")
    world = World()
    manager = CheckpointManager(storage, keep=1, async_save=async_save, fence=world)
    manager.save(SaveRequest(4, state(4)))
    assert manager.wait()
    marker = mf.parse_commit_marker(storage.read("step-00000004/" + mf.COMMIT_MARKER))
    assert (marker.store_epoch, marker.gen) == ("epoch-1", 3)
    world.planned_out = True
    manager.save(SaveRequest(8, state(8)))
    manager.wait()
    assert manager.failed_saves == 1 and isinstance(manager.last_error, FencedError)
    catalog = scan(storage)
    # The shards were written (a frozen writer's were, before it froze); no marker, no latest,
    # and keep=1 deleted nothing.
    assert [c.dir for c in catalog.commits] == ["step-00000004"]
    assert catalog.uncommitted == ("step-00000008",)
    assert mf.MANIFEST not in catalog.objects["step-00000008"]
    assert storage.read(mf.LATEST) == b"step-00000004"
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()
              if line.startswith('{"event"')]
    fenced = [e for e in events if e["event"] == "checkpoint_fenced"]
    assert len(fenced) == 1 and fenced[0]["step"] == 8, events
    assert "planned out" in fenced[0]["reason"]
    assert not any(e["event"] == "checkpoint_failed" for e in events), events


def test_without_a_fence_a_commit_records_no_generation(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ckpt")
    CheckpointManager(storage, async_save=False).save(SaveRequest(2, state(2)))
    data = json.loads(storage.read("step-00000002/" + mf.COMMIT_MARKER))
    assert "gen" not in data and mf.parse_commit_marker(json.dumps(data).encode()).gen == 0


class Answers:
    """A fence whose store always vouches for this writer (the old store, still running on the
    writer's dark side after the world replaced it: e2e scenario 6)."""

    def __init__(self, lineage: str, gen: int) -> None:
        self.lineage, self.gen = lineage, gen

    def __call__(self) -> tuple[str, int]:
        return self.lineage, self.gen


def dark_and_world(root: Path, first: int, *, keep: tuple[int, int]
                   ) -> tuple[LocalStorage, CheckpointManager, CheckpointManager]:
    """One root; a dark writer whose old store vouches for generation 21, which committed
    step `first`, and the world's writer in generation 22 of the same lineage (`keep`: theirs)."""
    storage = LocalStorage(root / "ckpt")
    dark = CheckpointManager(storage, keep=keep[0], async_save=False, run="r",
                             fence=Answers("found:a:1", 21))
    dark.save(SaveRequest(first, state(first)))
    world = CheckpointManager(storage, keep=keep[1], async_save=False, run="r",
                              fence=Answers("found:a:1", 22))
    return storage, dark, world


def test_a_writer_its_old_store_still_vouches_for_is_refused_once_its_world_committed_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The dark node's store answers for its generation 21; the world went on in another store
    of the same lineage and committed generation 22. The dark node's catalog knows only its own
    past: its save of the step the world committed is not written into the world's directory,
    and its save of another step is refused at the commit: no marker, `latest` the world's,
    its retention deletes nothing, and the world's checkpoint loads."""
    storage, dark, world = dark_and_world(tmp_path, 360, keep=(1, 2))
    world.save(SaveRequest(370, state(370)))
    assert world.failed_saves == 0
    dark.save(SaveRequest(370, state(-1)))  # its stop save, after the heal: the world's step
    assert dark.failed_saves == 1 and "already holds" in str(dark.last_error), dark.last_error
    dark.save(SaveRequest(371, state(-1)))
    assert dark.failed_saves == 2, dark.last_error
    assert "generation 22 of this lineage committed (step-00000370)" in str(dark.last_error)
    catalog = scan(storage)
    assert [c.dir for c in catalog.commits] == ["step-00000360", "step-00000370"]
    assert catalog.uncommitted == ("step-00000371",) and not catalog.damaged
    assert storage.read(mf.LATEST) == b"step-00000370"
    loaded = {"w": torch.zeros(4)}
    result = CheckpointManager(storage, async_save=False).load(loaded)
    assert result is not None and result.step == 370 and loaded["w"].tolist() == [370.0] * 4
    fenced = [json.loads(line) for line in capsys.readouterr().out.splitlines()
              if line.startswith('{"event": "checkpoint_fenced"')]
    assert [e["step"] for e in fenced] == [371], fenced


def test_a_newer_generation_of_another_lineage_or_run_refuses_nothing(tmp_path: Path) -> None:
    """A world founded anew (a new lineage: generations start over) or another run's commits
    say nothing about this writer's generation."""
    storage = LocalStorage(tmp_path / "ckpt")
    CheckpointManager(storage, async_save=False, run="r",
                      fence=Answers("found:a:1", 22)).save(SaveRequest(370, state(370)))
    CheckpointManager(storage, async_save=False, run="other",
                      fence=Answers("found:b:2", 40)).save(SaveRequest(380, state(380)))
    writer = CheckpointManager(storage, async_save=False, run="r",
                               fence=Answers("found:b:2", 3))
    writer.save(SaveRequest(390, state(390)))
    assert writer.failed_saves == 0, writer.last_error
    assert storage.read(mf.LATEST) == b"step-00000390"


class CountedReads(LocalStorage):
    """A local root that counts the commit markers read from it."""

    markers_read = 0

    def read(self, key: str) -> bytes:
        if key.endswith("/" + mf.COMMIT_MARKER):
            self.markers_read += 1
        return super().read(key)


def test_a_commits_check_reads_only_the_markers_its_writer_has_not_read(tmp_path: Path) -> None:
    """The check lists the root on every commit; a root that keeps many commits must not cost
    a read of each marker every time: only a commit this writer does not know yet is read (the
    world's, here), and it still refuses the stale writer."""
    storage = CountedReads(tmp_path / "ckpt")
    writer = CheckpointManager(storage, keep=100, async_save=False, run="r",
                               fence=Answers("found:a:1", 21))
    for step in range(1, 7):
        writer.save(SaveRequest(step, state(step)))
    assert writer.failed_saves == 0, writer.last_error
    # Its first save read the (empty) root's catalog; each commit after listed 1..5 commits of
    # its own and read none of their markers.
    assert storage.markers_read == 0
    CheckpointManager(storage, keep=100, async_save=False, run="r",
                      fence=Answers("found:a:1", 22)).save(SaveRequest(7, state(7)))
    read_before = storage.markers_read
    writer.save(SaveRequest(8, state(8)))
    assert "generation 22 of this lineage committed (step-00000007)" in str(writer.last_error)
    assert storage.markers_read - read_before == 1


def test_a_generation_record_refuses_a_stale_writer_before_the_world_commits_in_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """e2e scenario 6: the world regrouped to generation 22 and has not committed in it yet;
    the dark node, its old store still vouching for 21, makes its stop save. The world's
    record of entering 22 refuses it: no marker, `latest` unmoved. The world's own commit in 22
    goes in, and supersedes the record, which retention then deletes."""
    storage, dark, world = dark_and_world(tmp_path, 420, keep=(3, 3))
    marked = world.mark_generation("found:a:1", 22)
    assert marked is not None
    marked.join(timeout=30)
    (record,) = storage.list(mf.GENERATIONS + "/")
    assert mf.parse_generation_record(storage.read(record)).seq == 2
    dark.save(SaveRequest(423, state(-1)))
    assert dark.failed_saves == 1, "the stale writer's commit went in"
    assert "generation 22 of this lineage began" in str(dark.last_error), dark.last_error
    assert storage.read(mf.LATEST) == b"step-00000420"
    assert [c.dir for c in scan(storage).commits] == ["step-00000420"]
    world.save(SaveRequest(430, state(430)))
    assert world.failed_saves == 0, world.last_error
    assert storage.list(mf.GENERATIONS + "/") == [], "the superseded record was kept"
    assert [c.dir for c in scan(storage).commits] == ["step-00000420", "step-00000430"]
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()
              if line.startswith('{"event"')]
    assert [e["gen"] for e in events if e["event"] == "generation_recorded"] == [22]
    assert [e["step"] for e in events if e["event"] == "checkpoint_fenced"] == [423]
