"""The pure rules over a checkpoint root: commit order, candidates, directories, retention."""

from __future__ import annotations

import pytest

from elastrain_trainer.checkpoint import catalog as cat
from elastrain_trainer.checkpoint import manifest as mf

SHARDS = frozenset({"__0_0.distcp", ".metadata", mf.MANIFEST, mf.SIDECAR})


def committed(step: int, seq: int, run: str = "", attempt: int = 1) -> tuple[str, bytes]:
    d = mf.step_dir(step, attempt)
    return d, mf.build_commit_marker(step, mf.build_manifest(step, 1, {}), seq, run)


def build(*dirs: tuple[str, bytes | None], extra: dict[str, frozenset[str]] | None = None
          ) -> cat.Catalog:
    objects = {d: SHARDS | {mf.COMMIT_MARKER} for d, _ in dirs}
    objects.update(extra or {})
    return cat.build_catalog(objects, {d: m for d, m in dirs})


def test_listing_groups_step_directories_only() -> None:
    objects = cat.group_keys(["latest", "step-00000002/__0_0.distcp", "step-00000002/COMMITTED",
                              "step-00000002.2/x", "junk/COMMITTED", "step-12/COMMITTED",
                              ".elastrain-check/host-1"])
    assert objects == {"step-00000002": frozenset({"__0_0.distcp", "COMMITTED"}),
                       "step-00000002.2": frozenset({"x"})}
    assert cat.marker_dirs(objects) == ["step-00000002"]


def test_commit_order_not_step_order_says_which_is_newest() -> None:
    # Run 1 committed 4, 8, 12; a run that fell back (or started over) committed 4 and 8 again.
    catalog = build(committed(4, 1), committed(8, 2), committed(12, 3),
                    committed(4, 4, attempt=2), committed(8, 5, attempt=2))
    assert [c.dir for c in cat.resume_candidates(catalog)] == [
        "step-00000008.2", "step-00000004.2", "step-00000012", "step-00000008", "step-00000004"]
    assert catalog.newest == cat.Commit("step-00000008.2", 8, 5)
    assert catalog.next_seq() == 6


def test_markers_without_a_sequence_order_by_step_before_every_new_commit() -> None:
    old = [(mf.step_dir(s), f'{{"step": {s}, "manifest_sha256": "x"}}'.encode())
           for s in (10, 30, 20)]
    catalog = build(*old, committed(5, 1))
    assert [c.step for c in cat.resume_candidates(catalog)] == [5, 30, 20, 10]


def test_run_filter_resumes_only_that_runs_commits() -> None:
    catalog = build(committed(12, 3, "old"), committed(4, 4, "new", attempt=2))
    assert [c.dir for c in cat.resume_candidates(catalog, "new")] == ["step-00000004.2"]
    assert cat.resume_candidates(catalog, "other") == []


def test_damaged_markers_quarantine_and_uncommitted_are_never_candidates() -> None:
    catalog = build(committed(4, 1), (mf.step_dir(8), b"garbage"),
                    (mf.step_dir(12), mf.build_commit_marker(13, b"m", 3)),
                    extra={mf.step_dir(16): SHARDS,
                           mf.step_dir(20): SHARDS | {mf.COMMIT_MARKER, mf.QUARANTINED}})
    assert [c.step for c in cat.resume_candidates(catalog)] == [4]
    assert set(catalog.damaged) == {mf.step_dir(8), mf.step_dir(12), mf.step_dir(20)}
    assert "not a commit marker" in catalog.damaged[mf.step_dir(8)]
    assert "step 13" in catalog.damaged[mf.step_dir(12)]
    assert catalog.uncommitted == (mf.step_dir(16),)
    # A marker deleted between the listing and its read (retention) is not a commit.
    vanished = cat.build_catalog({mf.step_dir(4): SHARDS | {mf.COMMIT_MARKER}},
                                 {mf.step_dir(4): None})
    assert vanished.commits == () and vanished.uncommitted == (mf.step_dir(4),)


def test_a_save_never_gets_a_directory_that_holds_anything() -> None:
    taken = {mf.step_dir(12), mf.step_dir(12, 2), mf.step_dir(4)}
    assert cat.choose_dir(12, taken) == mf.step_dir(12, 3)
    assert cat.choose_dir(8, taken) == mf.step_dir(8)
    catalog = build(committed(12, 1), extra={mf.step_dir(16): frozenset({"__0_0.distcp"})})
    assert cat.choose_dir(16, catalog.taken()) == mf.step_dir(16, 2)


def test_retention_keeps_the_newest_commits_in_commit_order_and_every_damaged_one() -> None:
    # 12 proven damaged; training fell back to 8 and committed 12 and 16 again.
    catalog = build(committed(4, 1), committed(8, 2), committed(12, 3),
                    committed(12, 4, attempt=2), committed(16, 5))
    catalog = cat.with_damaged(catalog, mf.step_dir(12), "sha256 mismatch")
    assert cat.plan_retention(catalog, keep=2) == [mf.step_dir(4), mf.step_dir(8)]
    assert cat.plan_retention(catalog, keep=3) == [mf.step_dir(4)]
    # The old rule (highest step numbers) would have kept the older run's 12 over new work.
    restarted = build(committed(8, 1), committed(12, 2), committed(4, 3, attempt=2))
    assert cat.plan_retention(restarted, keep=1) == [mf.step_dir(8), mf.step_dir(12)]


def test_retention_drops_abandoned_partials_below_the_newest_commit_and_never_protected() -> None:
    catalog = build(committed(1, 1), committed(2, 2), committed(3, 3), committed(5, 4),
                    extra={mf.step_dir(4): SHARDS, mf.step_dir(6): SHARDS})
    assert cat.plan_retention(catalog, keep=2) == [mf.step_dir(1), mf.step_dir(2),
                                                   mf.step_dir(4)]
    assert cat.plan_retention(catalog, keep=0) == [mf.step_dir(1), mf.step_dir(2),
                                                   mf.step_dir(3), mf.step_dir(4)]
    assert cat.plan_retention(catalog, keep=2, protect={mf.step_dir(2)}) == [
        mf.step_dir(1), mf.step_dir(4)]


def test_catalog_follows_commits_failures_damage_and_deletions() -> None:
    catalog = build(committed(4, 1))
    catalog = cat.with_uncommitted(catalog, mf.step_dir(8))
    assert catalog.uncommitted == (mf.step_dir(8),)
    catalog = cat.with_commit(catalog, cat.Commit(mf.step_dir(8, 2), 8, 2), ["a"])
    assert [c.dir for c in catalog.commits] == [mf.step_dir(4), mf.step_dir(8, 2)]
    assert mf.step_dir(8, 2) in catalog.taken()
    catalog = cat.without(catalog, [mf.step_dir(4)])
    assert [c.dir for c in catalog.commits] == [mf.step_dir(8, 2)]


@pytest.mark.parametrize("keys,first", [
    (["s/a", "s/COMMITTED", "s/b"], "s/COMMITTED"),
    (["s/QUARANTINED", "s/COMMITTED"], "s/COMMITTED"),
])
def test_markers_are_deleted_first(keys: list[str], first: str) -> None:
    assert cat.deletion_order(keys)[0] == first


def made_in(step: int, seq: int, gen: int, store_epoch: str = "e1",
            attempt: int = 1) -> tuple[str, bytes]:
    d = mf.step_dir(step, attempt)
    return d, mf.build_commit_marker(step, mf.build_manifest(step, 1, {}), seq, "run",
                                     store_epoch, gen)


def test_a_commit_of_an_older_generation_not_above_a_newer_ones_is_fenced() -> None:
    # Generation 3 committed 8 (seq 2); its coordinator froze before committing 12 (seq 3) and
    # was planned out; generation 4 re-read the root and committed 14 as seq 3 too; the frozen
    # node woke and committed 12 as generation 3's seq 3.
    catalog = build(made_in(8, 2, 3), made_in(14, 3, 4), made_in(12, 3, 3))
    assert [c.dir for c in cat.resume_candidates(catalog)] == ["step-00000014", "step-00000008"]
    assert catalog.damaged["step-00000012"].startswith(
        "fenced: committed by generation 3 after generation 4 had committed step-00000014")
    assert catalog.next_seq() == 4
    # Never deleted by retention (kept like damaged), never the newest.
    assert "step-00000012" not in cat.plan_retention(catalog, keep=1)


def test_generations_of_other_store_epochs_or_runs_and_older_markers_are_not_compared() -> None:
    # A new store incarnation counts generations from 1 again; its commits are newer by seq.
    catalog = build(made_in(8, 2, 7, "e1"), made_in(12, 3, 1, "e2"), made_in(16, 4, 2, "e2"),
                    committed(20, 5))
    assert not catalog.damaged
    assert [c.step for c in cat.resume_candidates(catalog)] == [20, 16, 12, 8]
    # Ascending generations with ascending sequence numbers: the ordinary history.
    ordinary = build(made_in(4, 1, 1), made_in(8, 2, 1), made_in(12, 3, 2), made_in(16, 4, 5))
    assert not ordinary.damaged and len(ordinary.commits) == 4
    # An older generation's commit that is older in sequence too is history, not a fenced one.
    assert not build(made_in(4, 1, 2), made_in(8, 2, 3)).damaged


def test_a_marker_records_its_generation_and_store_epoch() -> None:
    marker = mf.parse_commit_marker(made_in(8, 2, 3, "abc")[1])
    assert (marker.store_epoch, marker.gen, marker.seq, marker.run) == ("abc", 3, 2, "run")
    plain = mf.parse_commit_marker(committed(8, 2)[1])
    assert (plain.store_epoch, plain.gen) == ("", 0)


def test_a_generation_record_fences_an_older_generations_commit_numbered_at_or_above_it(
        ) -> None:
    """A record fences as a commit of its generation would: the commit of generation 21 made
    when the world's next commit was to be 5 is a planned-out node's; one made before (4), or
    of another lineage or run, is not. A record is never a commit, never fenced itself."""
    def marker(step: int, seq: int, gen: int, lineage: str = "L", run: str = "r") -> bytes:
        return mf.build_commit_marker(step, b"m", seq, run, lineage, gen)

    objects = {d: frozenset({mf.COMMIT_MARKER}) for d in
               ("step-00000010", "step-00000020", "step-00000030", "step-00000040")}
    markers = {"step-00000010": marker(10, 4, 21), "step-00000020": marker(20, 5, 21),
               "step-00000030": marker(30, 5, 21, lineage="M"),
               "step-00000040": marker(40, 6, 21, run="other")}
    record = mf.generation_record_key("r", "L", 22)
    generations = cat.parse_records({record: mf.build_generation_record("r", "L", 22, 5)})
    catalog = cat.build_catalog(objects, markers, None, generations)
    assert [c.dir for c in catalog.commits] == ["step-00000010", "step-00000030",
                                                "step-00000040"]
    assert "generation 22 had begun " + record in catalog.damaged["step-00000020"]
    assert cat.outrun_by(catalog, "r", "L", 21) == generations[0]
    assert cat.outrun_by(catalog, "r", "M", 21) is None
    # Superseded once generation 22 (or newer) of its lineage commits.
    assert cat.superseded_generations(catalog) == []
    newer = cat.with_commit(catalog, cat.Commit("step-00000050", 50, 7, "r", "L", 22), ["x"])
    assert cat.superseded_generations(newer) == [record]
    assert cat.without(newer, [record]).generations == ()


def test_a_runs_line_is_its_newest_commits_or_records_lineage_at_its_highest_generation(
        ) -> None:
    """What a Restart-mode group on a new store continues (session.restart_fence): the lineage
    of the run's newest commit or record in commit order (not its highest generation number:
    an old store's line can have gone higher), at that lineage's highest generation; other
    runs, and markers made in no generation, are no line."""
    def commit(d: str, seq: int, lineage: str, gen: int, run: str = "r") -> cat.Commit:
        return cat.Commit(d, mf.parse_step_dir(d) or 0, seq, run, lineage, gen)

    catalog = cat.Catalog((commit("step-00000010", 1, "", 0),))
    assert cat.line_of(catalog, "r") is None
    catalog = cat.Catalog((commit("step-00000010", 1, "", 0), commit("step-00000020", 2, "A", 9),
                           commit("step-00000030", 3, "B", 2), commit("step-00000040", 4, "A", 3),
                           commit("step-00000050", 5, "C", 40, run="other")))
    assert cat.line_of(catalog, "r") == ("A", 9)
    assert cat.line_of(catalog, "other") == ("C", 40)
    record = cat.Commit(mf.generation_record_key("r", "B", 5), -1, 5, "r", "B", 5)
    assert cat.line_of(cat.Catalog(catalog.commits, generations=(record,)), "r") == ("B", 5)
