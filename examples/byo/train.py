"""A plain DDP script on a small model of its own, made elastic with elastrain's session.

Runs under torchrun (on Kubernetes: job.yaml; on this machine: `elastrain run
examples/byo/job.yaml --local --simulate-preemption`). What elastrain adds is the `Session`
block: resume from the newest committed checkpoint at any world size, periodic async saves to
spec.checkpoint.uri, a save on SIGTERM at the next step boundary, /progress and /metrics.

The data is synthetic and drawn per step from (SEED, step): a resumed run, at any world size,
trains on exactly the batches an uninterrupted run would have.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elastrain_trainer.api import Session, init_distributed, run

SEED = 1234
BATCH = 64  # global batch: split evenly over the ranks
FEATURES, HIDDEN, CLASSES = 32, 128, 10
LR = float(os.environ.get("BYO_LR", "3e-3"))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def teacher() -> torch.Tensor:
    """A fixed random linear map whose argmax is the label to learn."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(FEATURES, CLASSES, generator=g)


def batch(step: int, rank: int, world: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of `step`."""
    if BATCH % world:
        raise ValueError(f"batch {BATCH} does not split over {world} ranks")
    g = torch.Generator().manual_seed(SEED * 100_003 + step)
    x = torch.randn(BATCH, FEATURES, generator=g)
    y = (x @ w).argmax(dim=1)
    share = BATCH // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def main() -> None:
    env = init_distributed()  # torchrun's process group; env.device is cuda:LOCAL_RANK or cpu
    torch.manual_seed(SEED)   # the same initial weights on every rank
    model = Classifier().to(env.device)
    ddp = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    w = teacher()

    with Session(model=ddp, optimizer=optimizer, scheduler=scheduler) as session:
        if session.resumed_from is not None and env.rank == 0:
            print(f"resumed at step {session.resumed_from} on {env.world_size} rank(s)")
        for step in session.steps():
            x, y = (t.to(env.device) for t in batch(step, env.rank, env.world_size, w))
            loss = nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks
            optimizer.step()
            scheduler.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            session.report(loss=mean.item() / env.world_size, tokens=BATCH)

    # Reached only when training finished (a stop ends the process in the `with` above).
    if env.rank == 0:
        print(f"done: {session.step} steps")


if __name__ == "__main__":
    run(main)
