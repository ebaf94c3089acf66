"""The bound behind the sever (docs/recovery.md section 8): a training thread that a severed
generation did not release is restarted in place.

Severing a failed generation's sockets (`inprocess.sever`) fails every gloo wait that gloo
signals on a pair's error, but not all of them: `tcp::Pair::signalException` fails the pending
receives, the sends still queued and the bound buffers' sends under way, and leaves out an
*unbound* buffer's send already handed to the socket (`tx_` ops are signalled only through
`op.buf`). The allreduce that DDP issues sends through unbound buffers, so a send part-written
when its peer stopped reading (a peer frozen mid-collective, or this node frozen mid-send and
thawed after it was planned out) waits out the collective's full timeout (5 minutes), with its
heartbeat still beating. Seen: a node thawed after its world planned it out, its main thread in
`Reducer::finalize_backward` and its gloo thread in `UnboundBuffer::waitSend` 200 s on, every
socket of the group already closed by gloo.

No call returns that thread (gloo has no abort), so once the training thread has not come out
of a generation `bound_s` after this node severed it, the process exits EXIT_RESTART: its
launcher restarts it in place and it comes back through the join path, healed from a live peer
(what a planned-out node does anyway). A node saving the last step of a stop keeps its thread:
its save may take long and is the world's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from elastrain_trainer.events import emit
from elastrain_trainer.signals import EXIT_RESTART

# A released thread comes out of a failed collective within milliseconds of the sever (the
# pair's error); the bound is far above that and above a loaded machine's scheduling delays.
MIN_BOUND_S = 10.0


def bound_for(heartbeat_timeout_s: float) -> float:
    return max(MIN_BOUND_S, 2 * heartbeat_timeout_s)


class StuckWatch:
    """`still_in(gen)`: whether the training thread is still in generation `gen` (its plan's,
    not recovering, not saving a stop); `exit`: what ends the process (os._exit);
    `before_exit`: told first (the member announces its pod's rejoin: a node the world planned
    out while it was dark, restarted this way, must not be replaced meanwhile)."""

    def __init__(self, node_id: str, bound_s: float, still_in: Callable[[int], bool],
                 exit: Callable[[int], None] = os._exit,
                 before_exit: Callable[[], None] = lambda: None) -> None:
        self.node_id, self.bound_s = node_id, bound_s
        self._still_in, self._exit, self._before_exit = still_in, exit, before_exit
        self._lock = threading.Lock()
        self._released = 0  # the newest generation the training thread came out of

    def severed(self, gen: int) -> threading.Timer:
        """The heartbeat thread severed `gen`: check on the training thread `bound_s` on."""
        timer = threading.Timer(self.bound_s, self._check, args=(gen, time.monotonic()))
        timer.daemon = True
        timer.name = f"elastrain-stuck-{gen}"
        timer.start()
        return timer

    def released(self, gen: int) -> None:
        """The training thread came out of `gen` (a collective of it failed: it recovers)."""
        with self._lock:
            self._released = max(self._released, gen)

    def _check(self, gen: int, since: float) -> None:
        with self._lock:
            if self._released >= gen or not self._still_in(gen):
                return
        emit("stuck_in_severed_generation", node=self.node_id, gen=gen,
             after_s=round(time.monotonic() - since, 2),
             action="restart in place (a gloo send the sever did not fail)")
        with contextlib.suppress(Exception):  # the restart matters more than the telling
            self._before_exit()
        self._exit(EXIT_RESTART)
