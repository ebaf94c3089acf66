"""The process's data loaders, as the Session sees them.

Scripts build their DistributedSampler and DataLoader where torch's examples do: after the
process group exists, often before the Session. So `install()` (called by init_distributed()
and Session()) watches DataLoader construction: a loader over a DistributedSampler (or an
ElasticSampler) is adopted as it is built (loaders.sampler, loaders.loader), wherever the
script built it. The tracker holds their positions in creation order (the same on every rank
and in every run of one script), which the Session saves in the checkpoint's sidecar, sends to
joiners and restores; it sets each generation's world on them; and at each step boundary it
checks that the step consumed one global batch, which catches an accumulation computed from an
older world size.
"""

from __future__ import annotations

import functools
import json
import weakref
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from elastrain_trainer.config import accumulation_steps
from elastrain_trainer.loaders.loader import ElasticLoader, adopt_loader, sampler_of
from elastrain_trainer.loaders.sampler import ElasticSampler, Position, adopt
from elastrain_trainer.loaders.stream import adopt_stream, is_seekable


class StaleBatchError(ValueError):
    """A step consumed another number of samples than the global batch (a configuration
    error of the script: faults.py ends the job with it, quoted)."""


class Mark(NamedTuple):
    """A sampler's position at a step boundary."""

    epoch: int
    passes: int
    in_pass: bool
    offset: int
    pass_end: int

    @property
    def pass_key(self) -> tuple[int, int]:
        return self.epoch, self.passes


class DataTracker:
    def __init__(self) -> None:
        self.samplers: list[ElasticSampler] = []
        self.loaders: list[weakref.ref[ElasticLoader]] = []
        self.train: weakref.ref[ElasticLoader] | None = None
        self.iterable: list[str] = []  # loaders over an IterableDataset (not re-splittable)
        self.rank, self.world = 0, 1
        self.version = 0  # bumped when the world or the positions change under a pass
        self.global_batch: int | None = None
        self._pending: list[Position] = []
        self._last: list[Mark] | None = None

    # -- what the script built ------------------------------------------------------------
    def add_sampler(self, sampler: ElasticSampler) -> None:
        index = len(self.samplers)
        sampler.set_world(self.rank, self.world)
        if index < len(self._pending):  # built after the Session restored the positions
            sampler.restore(self._pending[index])
        self.samplers.append(sampler)

    def adopt(self, loader: DataLoader, *, train: bool = False) -> None:  # type: ignore[type-arg]
        sampler = sampler_of(loader)
        if isinstance(sampler, DistributedSampler):
            self._keep(adopt_loader(loader, adopt(sampler)), train)
        elif is_seekable(loader.dataset) and loader.batch_size is not None:
            self._keep(adopt_loader(loader, adopt_stream(loader.dataset, loader.batch_size)),
                       train)
        elif isinstance(loader.dataset, IterableDataset):
            self.iterable.append(type(loader.dataset).__name__)

    def _keep(self, adopted: ElasticLoader, train: bool) -> None:
        if not any(ref() is adopted for ref in self.loaders):
            self.loaders.append(weakref.ref(adopted))
        if train or self.train is None:
            self.train = weakref.ref(adopted)

    @property
    def micro_batch(self) -> int | None:
        """The training loader's batch size (Session(data=...), else the first adopted)."""
        loader = self.train() if self.train is not None else None
        return loader.micro_batch if loader is not None else None

    # -- what the Session does with them ------------------------------------------------------
    def set_world(self, rank: int, world: int) -> None:
        if (rank, world) == (self.rank, self.world):
            return
        self.rank, self.world = rank, world
        for sampler in self.samplers:
            sampler.set_world(rank, world)
        self.version += 1

    def state_dict(self) -> dict[str, Any]:
        return {"positions": json.dumps([s.position.to_json() for s in self.samplers]),
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = [Position.from_json(p) for p in json.loads(state["positions"])]
        for sampler, position in zip(self.samplers, self._pending, strict=False):
            sampler.restore(Position(**position.to_json()))
        if state.get("global_batch") is not None:
            self.global_batch = int(state["global_batch"])
        self.version += 1
        self._last = None

    def check_step(self, step: int) -> None:
        """At a step boundary: a pass that was under way at the last boundary and still is
        consumed one global batch since (or nothing: the step read another loader)."""
        now = [Mark(s.position.epoch, s.passes, s.position.in_pass, s.position.offset,
                    s.pass_end) for s in self.samplers]
        last, self._last = self._last, now
        if self.global_batch is None or last is None:
            return
        for sampler, before, after in zip(self.samplers, last, now, strict=False):
            # Only a step inside one pass, short of its end (an epoch's last step may be short).
            inside = (before.pass_key == after.pass_key and before.in_pass and after.in_pass
                      and before.offset < before.pass_end and after.offset < after.pass_end)
            read = after.offset - before.offset
            if inside and read not in (0, self.global_batch):
                raise StaleBatchError(self._stale_message(sampler, step, read))

    def _stale_message(self, sampler: ElasticSampler, step: int, read: int) -> str:
        micro = self.micro_batch or 1
        try:
            accum = accumulation_steps(self.global_batch or 0, micro, self.world)
            draws = f"session.accum = {accum}"
        except ValueError:
            draws = "session.accum"
        return (f"step {step} read {read} samples through its DataLoader "
                f"({getattr(sampler.dataset, 'name', type(sampler.dataset).__name__)}), "
                f"but the global batch is "
                f"{self.global_batch}: at world size {self.world} each rank draws {draws} "
                f"micro-batches of {micro} per step. Read session.accum inside the loop; an "
                "accumulation computed from an earlier world size is stale")


tracker = DataTracker()


def install() -> DataTracker:
    """Adopt every DataLoader built from now on whose sampler is distributed (idempotent).
    Subclasses that build themselves without DataLoader.__init__ (torchdata's
    StatefulDataLoader) are watched too: those defined already, and those defined later."""
    _watch(DataLoader)
    for cls in _subclasses(DataLoader):
        _watch(cls)
    if not getattr(DataLoader.__dict__.get("__init_subclass__"), "_elastrain", False):
        parent = super(DataLoader, DataLoader).__init_subclass__

        def __init_subclass__(cls: type, /, **kwargs: Any) -> None:
            parent.__func__(cls, **kwargs)  # type: ignore[attr-defined]
            _watch(cls)

        __init_subclass__._elastrain = True  # type: ignore[attr-defined]
        DataLoader.__init_subclass__ = classmethod(  # type: ignore[assignment]
            __init_subclass__)  # type: ignore[arg-type]
    return tracker


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    subs: list[type] = cls.__subclasses__()
    for sub in subs:
        found += [sub, *_subclasses(sub)]
    return found


def _watch(cls: type) -> None:
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_elastrain", False) or cls.__name__.startswith("Elastic"):
        return

    @functools.wraps(init)
    def __init__(self: DataLoader, *args: Any, **kwargs: Any) -> None:  # type: ignore[type-arg]
        init(self, *args, **kwargs)
        tracker.adopt(self)

    __init__._elastrain = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
