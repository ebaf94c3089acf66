"""A plain DDP script on a small model of its own, made elastic with elastrain's session.

Runs under torchrun (on Kubernetes: job.yaml; on this machine: `elastrain run
examples/byo/job.yaml --local --simulate-preemption`). What elastrain adds is the `Session`
block: resume from the newest committed checkpoint at any world size, periodic async saves to
spec.checkpoint.uri, a save on SIGTERM at the next step boundary, /progress and /metrics.

The data is the way most scripts read it: a DistributedSampler and a DataLoader with worker
processes, and gradient accumulation that keeps the global batch. The Session adopts the
sampler (it is re-split over each world and continued from the same position of the same
epoch after a leave, a join or a resume at another world size) and gives the accumulation at
the current world (`session.accum`): read it inside the loop, never compute it before.
"""

import json
import os
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from elastrain_trainer.api import Session, all_reduce, init_distributed, run

SEED = 1234
SAMPLES = 4096
MICRO = 16          # samples per micro-batch per rank (the DataLoader's batch_size)
GLOBAL_BATCH = 64   # samples per optimizer step over all ranks
FEATURES, HIDDEN, CLASSES = 32, 128, 10
LR = float(os.environ.get("BYO_LR", "3e-3"))
WORKERS = int(os.environ.get("BYO_LOADER_WORKERS", "2"))
# 1: each rank prints the sample indices it trained at each step (the e2e test checks that
# every sample is trained once per epoch across an eviction with it).
LOG_SAMPLES = os.environ.get("BYO_LOG_SAMPLES") == "1"


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def dataset() -> TensorDataset:
    """Fixed random inputs labelled by the argmax of a fixed random linear map (a teacher),
    with each sample's index."""
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1), torch.arange(SAMPLES))


def main() -> None:
    env = init_distributed()  # the process group; env.device is cuda:LOCAL_RANK or cpu
    torch.manual_seed(SEED)   # the same initial weights on every rank
    model = Classifier().to(env.device)
    ddp = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=SEED)  # adopted by the Session
    loader = DataLoader(data, batch_size=MICRO, sampler=sampler, num_workers=WORKERS)

    with Session(model=ddp, optimizer=optimizer, scheduler=scheduler,
                 global_batch=GLOBAL_BATCH) as session:
        if session.resumed_from is not None and session.rank == 0:
            print(f"resumed at step {session.resumed_from} on {session.world_size} rank(s)")
        it = iter(loader)
        for step in session.steps():
            optimizer.zero_grad(set_to_none=True)
            total, seen = torch.zeros(1), []
            for k in range(session.accum):  # micro-batches per rank at this world size
                try:
                    x, y, index = next(it)
                except StopIteration:  # the epoch's end
                    sampler.set_epoch(sampler.epoch + 1)
                    it = iter(loader)
                    x, y, index = next(it)
                seen += index.tolist()
                x, y = x.to(env.device), y.to(env.device)
                last = k == session.accum - 1
                with ddp.no_sync() if not last else torch.enable_grad():
                    loss = nn.functional.cross_entropy(ddp(x), y) / session.accum
                    loss.backward()  # DDP averages the gradients over the ranks on the last
                total += loss.detach().cpu()
            optimizer.step()
            scheduler.step()
            all_reduce(total)  # elastrain's: a peer lost here is noted, the step redone
            session.report(loss=total.item() / session.world_size, tokens=GLOBAL_BATCH)
            if LOG_SAMPLES:
                print(json.dumps({"event": "samples", "time": time.time(), "step": step,
                                  "rank": session.rank, "world_size": session.world_size,
                                  "epoch": sampler.epoch, "indices": seen}), flush=True)

    # Reached only when training finished (a stop ends the process in the `with` above).
    if session.rank == 0:
        print(f"done: {session.step} steps")


if __name__ == "__main__":
    run(main)
