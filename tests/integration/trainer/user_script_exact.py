"""A user's training script, written the way people write them (torch's DDP examples): a map-style
dataset through a DistributedSampler and a DataLoader built after init_distributed(), gradient
accumulation with no_sync, an LR schedule, an EMA of the weights, fp16 autocast with a
GradScaler, a process sub-group of its own (rebuilt in on_world_change) and a loss averaged
over the ranks, an epoch loop on StopIteration, an evaluation loop over a held-out set's
DistributedSampler every few steps, and (TEST_COMPILE=1) a torch.compile'd model. What
elastrain adds is the `with Session(...)` block. Run by test_user_scripts_exact.py under
elastrain's launcher, in both recovery modes.

It writes what it trained to $TEST_RECORDS: after each step, one JSON line per rank to
<node>-<pid>.jsonl (rank, step, world size, accumulation, epoch, sample indices, LR), and at the
end each rank's digests of its model, EMA and AdamW state (a `final` line) and rank 0's final
model and EMA weights to final.pt. Two hooks are the test's, not a user's:
TEST_HOLD_AT (steps at whose start every rank waits for the file release-<step>, so the test can
change the world at a known step boundary) and a SIGTERM note (sigterm-<pid>, so the test knows
the notice reached this process before it releases the hold)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastrain_trainer.api import (
    ElasticSampler,
    Session,
    World,
    all_reduce,
    init_distributed,
    run,
)

SEED = 1234
SAMPLES, FEATURES = 96, 8
MICRO = 4  # the DataLoader's batch_size: samples per micro-batch per rank
BASE_LR, WARMUP = 0.05, 4
STEPS = int(os.environ.get("ELASTRAIN_STEPS", "24"))
WORKERS = int(os.environ.get("TEST_LOADER_WORKERS", "0"))
OUT = Path(os.environ.get("TEST_RECORDS", "."))
HOLD_AT = {int(s) for s in os.environ.get("TEST_HOLD_AT", "").split(",") if s}
COMPILE = os.environ.get("TEST_COMPILE") == "1"
# The loader family: torch's DistributedSampler + DataLoader (distributed), the Session's own
# ElasticSampler (elastic), or torchdata's StatefulDataLoader over a DistributedSampler (stateful).
LOADER = os.environ.get("TEST_LOADER", "distributed")
EVAL_SAMPLES, EVAL_EVERY = 18, 5  # a held-out set, evaluated after every 5th step


def lr_factor(step: int) -> float:
    """Linear warmup, then cosine to 0 at STEPS (LambdaLR's factor after `step` steps)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def dataset() -> TensorDataset:
    """Features and each sample's index (the index is what the test checks)."""
    g = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.arange(SAMPLES))


def target(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return x @ torch.randn(FEATURES, 1, generator=g) + 0.5


class Records:
    def __init__(self) -> None:
        node = os.environ.get("ELASTRAIN_NODE_ID", "rank")
        self.file = (OUT / f"{node}-{os.getpid()}.jsonl").open("a", buffering=1)

    def write(self, event: str, **fields: object) -> None:
        self.file.write(json.dumps({"event": event, "pid": os.getpid(), "time": time.time(),
                                    "node": os.environ.get("ELASTRAIN_NODE_ID"), **fields})
                        + "\n")


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def hold(step: int, records: Records, rank: int, world: int) -> None:
    """The test's: wait at the start of `step` until it releases it."""
    if step not in HOLD_AT:
        return
    records.write("held", step=step, rank=rank, world=world)
    release = OUT / f"release-{step}"
    deadline = time.monotonic() + 300
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def note_sigterm() -> None:
    """The test's: touch sigterm-<pid> when a SIGTERM arrives, then do what the Session does."""
    previous = signal.getsignal(signal.SIGTERM)
    note = OUT / f"sigterm-{os.getpid()}"

    def noted(signum: int, frame: FrameType | None) -> None:
        note.touch()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, noted)


def evaluate(model: nn.Module, loader: DataLoader) -> list[float]:  # type: ignore[type-arg]
    """The usual evaluation loop: a whole pass of a held-out set's DistributedSampler shard,
    summed over the ranks (rank padding included, as torch's sampler pads)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, _ in loader:
            total += torch.tensor([nn.functional.mse_loss(model(x), target(x), reduction="sum")
                                   .item(), len(x)], dtype=torch.float64)
    model.train()
    all_reduce(total)
    return total.tolist()


def main() -> None:
    env = init_distributed()
    torch.manual_seed(SEED)
    net = nn.Linear(FEATURES, 1)
    # nanoGPT's order: compile, then DDP (aot_eager: the graphs without inductor's C++ build).
    model = DDP(torch.compile(net, backend="aot_eager") if COMPILE else net)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    data = dataset()
    sampler: DistributedSampler[Any] = (ElasticSampler(data, shuffle=True, seed=SEED)
                                        if LOADER == "elastic"
                                        else DistributedSampler(data, shuffle=True, seed=SEED))
    if LOADER == "stateful":  # torchdata's, which builds itself without DataLoader.__init__
        from torchdata.stateful_dataloader import StatefulDataLoader
        loader: DataLoader[Any] = StatefulDataLoader(
            data, batch_size=MICRO, sampler=sampler, num_workers=WORKERS,
            persistent_workers=False)
    else:
        loader = DataLoader(data, batch_size=MICRO, sampler=sampler, num_workers=WORKERS,
                            persistent_workers=False)
    g = torch.Generator().manual_seed(SEED + 2)
    held_out = TensorDataset(torch.randn(EVAL_SAMPLES, FEATURES, generator=g),
                             torch.arange(EVAL_SAMPLES))
    eval_loader = DataLoader(held_out, batch_size=MICRO,
                             sampler=DistributedSampler(held_out, shuffle=False))

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    groups: dict[str, dist.ProcessGroup] = {}

    def rebuild(old: World, new: World) -> None:  # a sub-group spans one world only
        group = dist.new_group(ranks=list(range(new.world_size)))
        assert isinstance(group, dist.ProcessGroup)
        groups["all"] = group

    with Session(model=model, optimizer=optimizer, scheduler=scheduler, ema=ema, scaler=scaler,
                 on_world_change=rebuild) as session:
        records = Records()
        note_sigterm()
        it = iter(loader)
        for step in session.steps():
            hold(step + 1, records, env.rank, env.world_size)
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]
            read: list[int] = []
            for k in range(session.accum):  # micro-batches per rank at this world size
                try:
                    x, idx = next(it)
                except StopIteration:  # the epoch's end
                    sampler.set_epoch(sampler.epoch + 1)
                    it = iter(loader)
                    x, idx = next(it)
                last = k == session.accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = model(x)
                    loss = nn.functional.mse_loss(out.float(), target(x)) / session.accum
                    scaler.scale(loss).backward()  # DDP averages the gradients on the last
                read += idx.tolist()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            ema.update_parameters(net)
            mean = loss.detach().clone()
            all_reduce(mean)  # elastrain's: a peer lost here is noted and the step redone
            members = torch.ones(1)  # a collective of the script's own, on its sub-group
            all_reduce(members, group=groups["all"])
            scores = evaluate(model, eval_loader) if (step + 1) % EVAL_EVERY == 0 else None
            records.write("step", step=step + 1, rank=env.rank, world=env.world_size,
                          accum=session.accum, epoch=sampler.epoch, indices=read, lr=lr,
                          group=int(members.item()), scale=scaler.get_scale(), eval=scores)
            session.report(loss=mean.item() / env.world_size)

    # Reached only when training finished.
    adam = {f"{p}.{k}": v for p, s in optimizer.state_dict()["state"].items() for k, v in s.items()}
    records.write("final", rank=session.rank, model=digest(net.state_dict()),
                  ema=digest(ema.state_dict()), adam=digest(adam),
                  last_epoch=scheduler.last_epoch)
    if session.rank == 0:
        torch.save({"model": net.state_dict(), "ema": ema.state_dict()},
                   OUT / "final.pt")


if __name__ == "__main__":
    run(main)
