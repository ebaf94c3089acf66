"""A process group the script makes with `dist.new_group` is severed with its generation's
(issue 34 item 2; docs/recovery.md section 8).

The heartbeat cuts a failed generation's gloo pairs, found among the sockets created while its
groups formed (inprocess.sever). A group the script makes later (a subgroup for its metrics, a
second data-parallel axis) has pairs and a listener of its own that were not among them: a
collective on it with a peer gone dark waited for its timeout, then the stuck-thread bound
restarted every survivor blocked in it, so the world lost its state. So while a node is in a
generation, `dist.new_group` is wrapped: the sockets the call created are added to the held
ones and its listeners published beside the generation's, and they are cut together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from elastrain_trainer.inprocess import sever

Adopt = Callable[[Iterable[int], Any], None]  # (socket_fds() before, the group made)
_adopt: list[Adopt] = []  # the process's member (one per process), set by track()


def track(adopt: Adopt) -> None:
    """From now on every `dist.new_group` in this process hands its sockets to `adopt`
    (Member.adopt_groups). Idempotent: the wrapper is installed once, the newest member wins."""
    _adopt[:] = [adopt]
    original = c10d.new_group
    if getattr(original, "elastrain_tracked", False):
        return

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        before = sever.socket_fds()
        group = original(*args, **kwargs)
        for hand_over in _adopt:
            hand_over(before, group)
        return group

    new_group.elastrain_tracked = True  # type: ignore[attr-defined]
    # Both names: `dist.new_group` is what scripts call, c10d's is what torch itself calls.
    c10d.new_group = new_group
    dist.new_group = new_group
