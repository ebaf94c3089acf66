"""SIGTERM agreement: any rank's SIGTERM makes every rank save the same step, then exit.

The handler only sets a flag (a signal can land inside a collective). At each step
boundary all ranks all-reduce the flag; if any rank was signalled, all save that step.
Then a signalled rank exits 0 (its agent is stopping it anyway) and an unsignalled
survivor exits EXIT_RESTART, so its torchrun agent restarts the group and re-rendezvouses
instead of treating the job as finished.

    stop = StopAgreement().install()
    for step in ...:
        train_step()
        if stop.agree():
            checkpoint(step)
            sys.exit(stop.exit_code())
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

EXIT_OK = 0
# "Restart me": EX_TEMPFAIL from sysexits.h; distinct from crashes (1) and signals (128+n).
EXIT_RESTART = 75
# In-process recovery only: the job's store is gone and a membership change needs it; the
# launcher ends the pod as a torchrun agent does when it loses its rendezvous store
# (RendezvousConnectionError), so the pod is replaced and resumes from the newest checkpoint.
EXIT_STORE_LOST = 76


class StopAgreement:
    """Remembers a SIGTERM and turns it into one collective decision per step."""

    def __init__(self) -> None:
        self.signalled = False
        self.signal_name: str | None = None

    def install(self, signums: tuple[int, ...] = (signal.SIGTERM,)) -> StopAgreement:
        for signum in signums:
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True
        self.signal_name = signal.Signals(signum).name

    def agree(self, group: dist.ProcessGroup | None = None) -> bool:
        """True on every rank if any rank was signalled (a collective: call on all ranks)."""
        return self.agree_with(group)[0]

    def agree_with(self, group: dist.ProcessGroup | None = None,
                   *others: bool) -> tuple[bool, ...]:
        """(stop, *others) each OR-ed over all ranks, in one small all-reduce.

        Piggy-backs other per-step decisions that must be unanimous (e.g. "the checkpoint
        interval in seconds has elapsed", where rank clocks differ).
        """
        flags = torch.tensor([self.signalled, *others], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return tuple(bool(v) for v in flags.tolist())

    def exit_code(self) -> int:
        return EXIT_OK if self.signalled else EXIT_RESTART
