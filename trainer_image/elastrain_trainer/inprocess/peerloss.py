"""A peer lost without notice while the script's loop body runs (docs/recovery.md sections 6, 13).

The body's collective is DDP's gradient all-reduce in `backward()`; if it raised, the exception
would leave the script's `for step in session.steps()` loop and the Session could not resume it.
So in in-process mode the Session's DDP all-reduces through `allreduce_or_note`, the default
hook's arithmetic (multiply by 1/world, sum: bit-identical to DDP's built-in path) whose failure
is noted here instead of raised, and the optimizer's step pre-hook drops every gradient when a
failure was noted, so `optimizer.step()` changes nothing (the commit rule: a step that lost a
peer is applied by no rank that saw the loss). The body's own collectives go through
`api.all_reduce` (here: `all_reduce`) for the same reason. The Session reads `error` when the
body hands control back at the next yield, and recovers there, outside any `except` block,
after it has released DDP's hold on the failed group: the step is redone unless its optimizer
step had already run (`committed`: a loss seen after it, in a validation pass).

No `from __future__ import annotations` here: DDP checks a comm hook's annotations at runtime.
"""

import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # type: ignore[attr-defined]
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.hooks import RemovableHandle


class PeerLoss:
    """The failure noted during this step's body, if any, and the hooks that note it."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.committed = False  # this body's optimizer step ran before any loss was noted
        self._hooks: list[RemovableHandle] = []

    def note(self, error: BaseException) -> None:
        if self.error is None:
            self.error = f"{type(error).__name__}: {error}"

    def clear(self) -> None:
        self.error = None

    def attach(self, model: DDP, optimizer: torch.optim.Optimizer) -> None:
        """After each (re-)wrap: DDP's fresh Reducer has no hook yet. The optimizer's pre-hook
        is registered once."""
        model.register_comm_hook(self, allreduce_or_note)
        if not self._hooks:
            self._hooks = [optimizer.register_step_pre_hook(self._drop_grads_if_lost),
                           optimizer.register_step_post_hook(self._note_commit)]

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType,
                   group: dist.ProcessGroup | None = None) -> None:
        """A collective of the body's own (a loss average): a failure is noted, not raised;
        after one, the broken group is not waited on again."""
        if self.error is not None:
            return
        try:
            dist.all_reduce(tensor, op=op, group=group)
        except RuntimeError as e:
            self.note(e)

    @staticmethod
    def detach(model: DDP) -> None:
        """Forget this hook on `model` (rewrap refuses any other comm hook)."""
        model._comm_hooks = [h for h in model._comm_hooks if h[0] is not allreduce_or_note]

    def _drop_grads_if_lost(self, optimizer: torch.optim.Optimizer, args: object,
                            kwargs: object) -> None:
        if self.error is None:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # a parameter without a gradient is left as it is

    def _note_commit(self, optimizer: torch.optim.Optimizer, args: object,
                     kwargs: object) -> None:
        self.committed = self.error is None


def allreduce_or_note(state: PeerLoss,
                      bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    tensor = bucket.buffer()
    if state.error is not None:  # the group is broken: do not wait on it again this step
        return _done(tensor)
    try:
        # As DDP's built-in path: each gradient times 1/world, then summed over ranks.
        tensor.mul_(1.0 / dist.get_world_size())
        fut = dist.all_reduce(tensor, async_op=True).get_future()  # type: ignore[union-attr]
    except RuntimeError as e:
        state.note(e)
        return _done(tensor)

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            reduced: torch.Tensor = f.value()[0]
            return reduced
        except RuntimeError as e:
            state.note(e)
            return tensor

    return fut.then(finish)


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
