"""A collective on a process group of an earlier world is refused, naming the fix.

When the world changes in process, every process group of the old generation is destroyed and
the next generation's default group and the Session's own groups are made (inprocess/regroup.py).
A group the script made with `dist.new_group` before the change is destroyed with them, but gloo
keeps its connections: a collective on it still runs over the old members without an error (the
survivors' sockets are alive), so a sub-group's reduction silently leaves a joiner out, or waits
out the collective timeout for a lost member. torch offers no way to make such a group fail
(`abort()` and `shutdown()` on it were tried: its all_reduce still ran), so the check is made
where every c10d collective starts: each asks `_rank_not_in_group(group)` first, and the hook
there refuses a group c10d no longer knows. The fix it names: rebuild the group in
`Session(on_world_change=...)`.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch.distributed as dist

from elastrain_trainer.private_hooks import require

_NEEDED_FOR = ("to refuse a collective on a process group destroyed by a world change "
               "(session/stale_groups.py)")


class StaleGroupError(RuntimeError):
    """A collective on a process group of an earlier generation (destroyed)."""


def install() -> None:
    """Refuse collectives on destroyed groups from now on, in this process (idempotent)."""
    import torch.distributed.distributed_c10d as c10d

    original = require(c10d, "_rank_not_in_group", library="torch", needed_for=_NEEDED_FOR)
    if getattr(original, "elastrain_checks_stale_groups", False):
        return
    require(c10d, "_world", library="torch", needed_for=_NEEDED_FOR)
    require(c10d._world, "pg_map", library="torch", needed_for=_NEEDED_FOR,
            owner_name="torch.distributed.distributed_c10d._world")

    def _rank_not_in_group(group: Any) -> bool:
        if isinstance(group, dist.ProcessGroup) and group not in c10d._world.pg_map:
            raise StaleGroupError(_message(group, _called(c10d.__file__)))
        return bool(original(group))

    _rank_not_in_group.elastrain_checks_stale_groups = True  # type: ignore[attr-defined]
    c10d._rank_not_in_group = _rank_not_in_group  # type: ignore[assignment]


def _called(c10d_file: str) -> str:
    """The c10d function the script called, for the message: the outermost c10d frame, or
    the function torch's logging decorator wraps (whose error path asks get_backend again);
    "a collective" where neither is found."""
    frame: FrameType | None = sys._getframe(2)
    name = "collective"
    while frame is not None:
        where = frame.f_code.co_filename
        if where == c10d_file:
            name = frame.f_code.co_name
        elif f"torch{os.sep}distributed{os.sep}" not in where:
            break
        elif callable(wrapped := frame.f_locals.get("func")):
            name = getattr(wrapped, "__name__", name)
        frame = frame.f_back
    return name


def _message(group: dist.ProcessGroup, op: str) -> str:
    size = group.size()
    call = "a collective" if op == "collective" else f"dist.{op}"
    return (f"{call} on a process group of {size} rank{'s' * (size != 1)} that no longer "
            "exists: it was made (dist.new_group) before the world changed, and still holds "
            "the old members. Rebuild it in Session(on_world_change=...), which runs at every "
            "world change with the new world (the default group is always the current one)")
