"""What a checkpoint root holds, and the pure rules over it: commit order, what to resume, the
directory a new save gets, and what retention deletes.

Commit order, not the step number, says which checkpoint is newest: a run that fell back to an
older checkpoint, or was told to start over, saves the same step numbers again, and its new
work must win over the old directories of those steps (and survive retention). Each
COMMITTED marker carries a sequence number one above every commit the writer knew of;
markers written before sequence numbers existed count as 0 and order by step.

Fencing (in-process mode, docs/recovery.md section 8, "Fencing"). A bucket cannot check who
writes, so each commit records the lineage (the store incarnation that founded its line of
generations, carried on through stores replaced and restored: `store_epoch`) and the
generation whose world made it. Within one run and one lineage, generations only grow and a
newer generation's coordinator numbers its commits above every commit it could read, so a
commit of an older generation whose sequence number is not above a newer generation's commit
was made by a node planned out of the world (frozen or cut off while the others went on) after
the others had moved on: it is fenced, never loaded, never `latest`, and kept like a damaged
one. Its writer refuses most of them first: the store's answer (manager.py's `fence`), then
the bucket's own newer commits (`outrun_by`), which also hold when the store that answered was
an old one still running beside the cut-off writer.

Until a new generation commits, the bucket would hold nothing of it, and a node cut off with an
old store that still vouches for it could commit into that gap (e2e scenario 6: the dark
worker's stop save, committed right after the partition lifted, before the world's first save
in its new generation). So the world's coordinator writes a generation record when it enters a
generation (`generations/`, manifest.build_generation_record): the sequence number the world's
next commit gets and the generation, which fences exactly as a commit of that generation would
(`fenced_commits`, `outrun_by`). A record is dropped once its lineage has a commit of its
generation or a newer one (`superseded_generations`): that commit fences from then on.

A save never writes into a directory that already holds objects (`choose_dir`): the first save
of step 12 gets `step-00000012`, a later one `step-00000012.2`, so nothing committed is ever
overwritten. A checkpoint proven damaged is kept (QUARANTINED, or known to the manager) and
neither resumed from nor deleted by retention.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from elastrain_trainer.checkpoint import manifest as mf


@dataclass(frozen=True)
class Commit:
    """One committed checkpoint directory (or a generation record: `dir` its key, `step` -1)."""

    dir: str
    step: int
    seq: int = 0
    run: str = ""
    store_epoch: str = ""
    gen: int = 0  # 0: not made in a generation (no fence: a local run, or an older marker)

    def order(self) -> tuple[int, int, int]:
        parsed = mf.parse_dir(self.dir)
        return self.seq, self.step, parsed[1] if parsed else 0


@dataclass(frozen=True)
class Catalog:
    """The step directories under a root, as one listing (and the commit markers) showed them."""

    commits: tuple[Commit, ...] = ()  # usable, oldest first in commit order
    damaged: Mapping[str, str] = field(default_factory=dict)  # dir -> why (never loaded, kept)
    uncommitted: tuple[str, ...] = ()  # dirs with objects and no commit marker
    objects: Mapping[str, frozenset[str]] = field(default_factory=dict)  # dir -> object names
    generations: tuple[Commit, ...] = ()  # generation records (step -1), by key

    @property
    def newest(self) -> Commit | None:
        return self.commits[-1] if self.commits else None

    def taken(self) -> frozenset[str]:
        """Every directory that holds objects: no save may write into one of them."""
        return frozenset(self.objects)

    def next_seq(self) -> int:
        return max((c.seq for c in self.commits), default=0) + 1


def group_keys(keys: Iterable[str]) -> dict[str, frozenset[str]]:
    """Step directory -> the names of its objects (keys outside step directories are ignored)."""
    groups: dict[str, set[str]] = {}
    for key in keys:
        head, _, rest = key.partition("/")
        if rest and mf.parse_dir(head) is not None:
            groups.setdefault(head, set()).add(rest)
    return {d: frozenset(names) for d, names in groups.items()}


def marker_dirs(objects: Mapping[str, frozenset[str]],
                known: Mapping[str, Commit] | None = None) -> list[str]:
    """The directories whose commit marker must be read to know their place in commit order
    (`known`: commits already read, whose markers need no second read: a marker is written
    once and never changed)."""
    return sorted(d for d, names in objects.items()
                  if mf.COMMIT_MARKER in names and mf.QUARANTINED not in names
                  and d not in (known or {}))


def record_keys(keys: Iterable[str], known: Mapping[str, Commit] | None = None) -> list[str]:
    """The generation records among a listing's keys that must be read (not in `known`)."""
    return sorted(k for k in keys if k.startswith(mf.GENERATIONS + "/") and k not in (known or {}))


def parse_records(records: Mapping[str, bytes | None],
                  known: Mapping[str, Commit] | None = None,
                  listed: Iterable[str] = ()) -> tuple[Commit, ...]:
    """The generation records read (a record unreadable or vanished is no record: it fences
    nothing, as a world that wrote none) and those `known` still `listed`."""
    present = set(listed)
    out = [c for k, c in (known or {}).items() if k in present and c.step < 0]
    for key, data in records.items():
        if data is None:
            continue
        try:
            marker = mf.parse_generation_record(data)
        except mf.CorruptCheckpointError:
            continue
        out.append(Commit(key, -1, marker.seq, marker.run, marker.store_epoch, marker.gen))
    return tuple(sorted(out, key=lambda c: c.dir))


def build_catalog(objects: Mapping[str, frozenset[str]],
                  markers: Mapping[str, bytes | None],
                  known: Mapping[str, Commit] | None = None,
                  generations: tuple[Commit, ...] = ()) -> Catalog:
    """The catalog from a listing and the bytes of the markers `marker_dirs` named (None: the
    marker vanished between the listing and the read, as retention's deletion does), the
    `known` commits whose markers were not read again, and the generation records
    (parse_records)."""
    commits: list[Commit] = []
    damaged: dict[str, str] = {}
    uncommitted: list[str] = []
    for d, names in sorted(objects.items()):
        parsed = mf.parse_dir(d)
        assert parsed is not None
        if mf.QUARANTINED in names:
            damaged[d] = "quarantined earlier"
        elif known and d in known and mf.COMMIT_MARKER in names:
            commits.append(known[d])
        elif mf.COMMIT_MARKER not in names or markers.get(d) is None:
            uncommitted.append(d)
        else:
            data = markers[d]
            assert data is not None
            try:
                marker = mf.parse_commit_marker(data)
            except mf.CorruptCheckpointError as e:
                damaged[d] = str(e)
                continue
            if marker.step != parsed[0]:
                damaged[d] = f"its commit marker names step {marker.step}"
                continue
            commits.append(Commit(d, parsed[0], marker.seq, marker.run, marker.store_epoch,
                                  marker.gen))
    fenced = fenced_commits(commits, generations)
    damaged |= fenced
    commits = sorted((c for c in commits if c.dir not in fenced), key=Commit.order)
    return Catalog(tuple(commits), damaged, tuple(uncommitted), dict(objects), generations)


def fenced_commits(commits: Iterable[Commit],
                   generations: Iterable[Commit] = ()) -> dict[str, str]:
    """Directory -> why, for each commit that a newer generation of its run and store epoch had
    already outnumbered when it was made, by a commit or a generation record (the module's
    docstring: a planned-out writer's)."""
    newest: dict[tuple[str, str], list[Commit]] = {}
    for c in (*commits, *generations):
        if c.gen > 0:
            newest.setdefault((c.run, c.store_epoch), []).append(c)
    fenced: dict[str, str] = {}
    for group in newest.values():
        for c in group:
            if c.step < 0:
                continue  # a record fences; it is never fenced
            newer = [d for d in group if d.gen > c.gen and d.seq <= c.seq]
            if newer:
                first = min(newer, key=Commit.order)
                done = "begun" if first.step < 0 else "committed"
                fenced[c.dir] = (f"fenced: committed by generation {c.gen} after generation "
                                 f"{first.gen} had {done} {first.dir} (a node planned out of "
                                 "the world wrote it)")
    return fenced


def outrun_by(catalog: Catalog, run: str, lineage: str, gen: int) -> Commit | None:
    """The first commit of `run` and `lineage` that a generation newer than `gen` made (None:
    none, or `gen` 0, which fences nothing). A save never spans two generations, so once one
    exists a commit of `gen` can only be a planned-out node's: its writer refuses it rather
    than leave it for `fenced_commits` (and it writes no `latest` and deletes nothing)."""
    if gen <= 0:
        return None
    return next((c for c in (*catalog.commits, *catalog.generations)
                 if c.run == run and c.store_epoch == lineage and c.gen > gen), None)


def line_of(catalog: Catalog, run: str) -> tuple[str, int] | None:
    """(lineage, highest generation) of `run`'s newest commit or generation record, in commit
    order: the line a Restart-mode group on a new store continues (session.restart_fence);
    None: `run` has none made in a generation."""
    made = [c for c in (*catalog.commits, *catalog.generations) if c.run == run and c.gen > 0]
    if not made:
        return None
    lineage = max(made, key=Commit.order).store_epoch
    return lineage, max(c.gen for c in made if c.store_epoch == lineage)


def superseded_generations(catalog: Catalog) -> list[str]:
    """Generation records whose lineage has since committed in their generation or a newer
    one: that commit fences what the record did (its sequence number is the record's or
    above, and a writer with a catalog that old is refused by the commit's generation)."""
    newest: dict[tuple[str, str], int] = {}
    for c in catalog.commits:
        key = (c.run, c.store_epoch)
        newest[key] = max(newest.get(key, 0), c.gen)
    return [r.dir for r in catalog.generations
            if r.gen <= newest.get((r.run, r.store_epoch), 0)]


def resume_candidates(catalog: Catalog, run: str | None = None) -> list[Commit]:
    """Commits to try, newest commit first; each is the fallback for the one before it.
    `run`: only that run's own commits (a run told to start over ignores older work)."""
    return [c for c in reversed(catalog.commits) if run is None or c.run == run]


def choose_dir(step: int, taken: Collection[str]) -> str:
    """The first directory of `step` that holds nothing yet."""
    attempt = 1
    while mf.step_dir(step, attempt) in taken:
        attempt += 1
    return mf.step_dir(step, attempt)


def plan_retention(catalog: Catalog, keep: int, protect: Collection[str] = ()) -> list[str]:
    """Directories to delete: commits older (in commit order) than the newest `keep`, and
    abandoned uncommitted directories of steps below the newest commit's. Never a damaged
    directory (kept for a post-mortem), never one in `protect` (the one training resumed from,
    the one being written)."""
    keep = max(1, keep)
    doomed = [c.dir for c in catalog.commits[:-keep]]
    newest = catalog.newest
    if newest is not None:
        doomed += [d for d in catalog.uncommitted if (mf.parse_step_dir(d) or 0) < newest.step]
    return sorted(d for d in doomed if d not in protect and d not in catalog.damaged)


def deletion_order(keys: list[str]) -> list[str]:
    """Commit markers first, so a half-deleted checkpoint never looks committed."""
    return sorted(keys, key=lambda k: (not k.endswith("/" + mf.COMMIT_MARKER), k))


def with_commit(catalog: Catalog, commit: Commit, names: Iterable[str]) -> Catalog:
    """The catalog once `commit` (holding `names`) is committed."""
    commits = sorted([*(c for c in catalog.commits if c.dir != commit.dir), commit],
                     key=Commit.order)
    return Catalog(tuple(commits), catalog.damaged,
                   tuple(d for d in catalog.uncommitted if d != commit.dir),
                   {**catalog.objects, commit.dir: frozenset(names)}, catalog.generations)


def with_uncommitted(catalog: Catalog, d: str) -> Catalog:
    """The catalog once a save into `d` failed (whatever it wrote stays until retention)."""
    if d in catalog.uncommitted or any(c.dir == d for c in catalog.commits):
        return catalog
    return Catalog(catalog.commits, catalog.damaged, (*catalog.uncommitted, d),
                   {**catalog.objects, d: catalog.objects.get(d, frozenset())},
                   catalog.generations)


def with_damaged(catalog: Catalog, d: str, why: str) -> Catalog:
    """The catalog once `d` is proven damaged: never a candidate, never deleted by retention."""
    return Catalog(tuple(c for c in catalog.commits if c.dir != d), {**catalog.damaged, d: why},
                   tuple(u for u in catalog.uncommitted if u != d),
                   {**catalog.objects, d: catalog.objects.get(d, frozenset())},
                   catalog.generations)


def without(catalog: Catalog, dirs: Collection[str]) -> Catalog:
    """The catalog once `dirs` (and generation records) are deleted."""
    return Catalog(tuple(c for c in catalog.commits if c.dir not in dirs), catalog.damaged,
                   tuple(d for d in catalog.uncommitted if d not in dirs),
                   {d: n for d, n in catalog.objects.items() if d not in dirs},
                   tuple(r for r in catalog.generations if r.dir not in dirs))
