"""A script on the Session API that reads its batches through a DataLoader with worker processes
(num_workers=2), run under elastrain's launcher by test_loader_workers_notice.py. The trainer
and each loader worker append a line to <TEST_OUT>/pids ("trainer PID", "loader PID"): the test
counts the trainers started and checks that no loader worker outlives the run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastrain_trainer.api import Session, init_distributed, run


def note_pid(role: str) -> None:
    with (Path(os.environ["TEST_OUT"]) / "pids").open("a") as f:
        f.write(f"{role} {os.getpid()}\n")


def endless(loader: DataLoader[tuple[torch.Tensor, ...]],
            sampler: DistributedSampler[tuple[torch.Tensor, ...]]) -> Iterator[
                tuple[torch.Tensor, ...]]:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    note_pid("trainer")
    env = init_distributed()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    with Session(model=model, optimizer=optimizer) as session:
        sampler = DistributedSampler(data, num_replicas=env.world_size, rank=env.rank)
        loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2,
                            worker_init_fn=lambda _: note_pid("loader"))
        batches = endless(loader, sampler)
        for _ in session.steps():
            x, y = next(batches)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            session.report(loss=loss.item())


if __name__ == "__main__":
    run(main)
