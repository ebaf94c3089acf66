"""One node of the in-process recovery tests: a tiny DDP job on gloo, run as a real process.

    python inprocess_worker.py inprocess --node a --port P --run R --out DIR --steps 30 [...]
    python inprocess_worker.py restart --rank 0 --world 3 --port P --run R --out DIR --until 10

`inprocess` is one node of elastrain_trainer.inprocess (Member: join, boundary, change, recover,
settle); `restart` is today's path done by hand: a fresh process group, `DDP(net)`, the state
loaded from the last checkpoint (a plain torch.save of model, optimizer and step), trained to
`--until`, saved, exit. Both train the same steps with the same code: the global batch and the
sample order never depend on the world size (data.micro_batch_indices), the LR is a function of
the step. Each node writes JSON lines (steps, regroups, failures) to DIR/<node>.jsonl and its
final state to DIR/<node>.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elastrain_trainer.data import micro_batch_indices
from elastrain_trainer.inprocess import user_groups
from elastrain_trainer.inprocess.member import Member, MemberConfig
from elastrain_trainer.inprocess.membership import PlanConfig
from elastrain_trainer.inprocess.transfer import state_digest
from elastrain_trainer.parallel import gradient_sync

GLOBAL_BATCH, MICRO = 12, 2
HOST = "127.0.0.1"


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(16, generator=g)
    return x, torch.stack([x[:4].sum(), x[4:8].prod(), x[8:].mean(), x.max()]).tanh()


def lr_at(step: int, total: int) -> float:
    return 1e-2 * (1.0 - 0.5 * step / total)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, world: int, rank: int,
               total: int) -> float:
    """One optimizer step of the global batch `step`, this rank's share of it."""
    accum = GLOBAL_BATCH // (MICRO * world)
    opt.zero_grad(set_to_none=True)
    total_loss = 0.0
    for k in range(accum):
        idx = micro_batch_indices(step * GLOBAL_BATCH, MICRO, world, rank, k)
        xs, ys = zip(*(sample(i) for i in idx), strict=True)
        with gradient_sync(model, k == accum - 1):
            loss = nn.functional.mse_loss(model(torch.stack(xs)), torch.stack(ys)) / accum
            loss.backward()  # type: ignore[no-untyped-call]
        total_loss += loss.item()
    for group in opt.param_groups:
        group["lr"] = lr_at(step, total)
    opt.step()
    return total_loss


class Log:
    def __init__(self, out: Path, node: str) -> None:
        self.f = (out / f"{node}.jsonl").open("a", buffering=1)
        self.node = node

    def __call__(self, event: str, **fields: Any) -> None:
        self.f.write(json.dumps({"event": event, "node": self.node, "pid": os.getpid(),
                                 "t": time.time(), **fields}) + "\n")


def save_final(out: Path, node: str, model: DDP, opt: torch.optim.Optimizer, step: int) -> None:
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "digest": state_digest(model, opt)}, out / f"{node}.pt")


# ---------------------------------------------------------------- in-process
def run_inprocess(a: argparse.Namespace) -> int:
    out, log = Path(a.out), Log(Path(a.out), a.node)
    told_lost_now = [False]
    member = Member(MemberConfig(
        node_id=a.node, store_host=HOST, store_port=a.port, run_id=a.run,
        plan=PlanConfig(GLOBAL_BATCH, MICRO, max_world=3, min_world=1), expected=a.expected,
        heartbeat_timeout_s=a.heartbeat_timeout, hold_budget_s=a.hold_budget,
        # As the operator's control says of a pod it moves off a node with a notice.
        moving=(lambda: frozenset({a.node})) if a.moving else frozenset,
        # As the operator's control says of pods on a node it knows lost, from a step on.
        lost=lambda: frozenset(a.told_lost) if told_lost_now[0] else frozenset()))
    member.install_signal()
    member.wait_alone()
    if a.user_group:
        user_groups.track(member.adopt_groups)
    net, opt = build()
    model = DDP(net)
    if a.join_gate:  # warm: imported and built; ask to join only when the test says so
        member.store.raw.wait([a.join_gate], timedelta(seconds=300))
    plan = member.join()
    step, _ = member.settle(model, opt, step=plan.step, extras={})
    log("joined", gen=plan.gen, world=plan.world_size, rank=member.rank, step=step,
        healed_from=member.last.healed_from if member.last else None,
        digest=state_digest(model, opt))
    # A group of the script's own, made in each generation (as a script's metrics group).
    ugroup = dist.new_group() if a.user_group else None
    while step < a.steps:
        assert member.plan is not None
        failure: str | None = None
        try:
            if ugroup is not None:
                if step == a.stall_at:  # its peers wait for it in the group's all-reduce
                    log("stalling", step=step)
                    time.sleep(5)
                dist.all_reduce(torch.ones(1), group=ugroup)
            loss = train_step(model, opt, step, member.plan.world_size, member.rank, a.steps)
            step += 1
            log("step", step=step, world=member.plan.world_size, gen=member.plan.gen,
                loss=loss)
            if a.sleep:
                time.sleep(a.sleep)
            told_lost_now[0] = bool(a.told_lost) and step >= a.told_lost_at
            if step == a.leave_at:
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled as any SIGTERM
            if step == a.hold_at and member.rank == 0:
                member.store.raw.set(a.hold_key, "go")
                while member.store.pending() == member.plan.pending:
                    time.sleep(0.01)
            if not member.boundary(step)[0]:
                continue
            t0 = time.monotonic()
            if member.change(step) is None:
                log("left", step=step)
                return 0
        except RuntimeError as e:  # a collective failed: a peer is gone
            failure = str(e).splitlines()[0][:200]
        if failure is not None:
            # Outside the except block: its traceback (the failed step's frames, tensors and
            # pending work) would keep the failed group alive, and its sockets open.
            log("failed", step=step, error=failure)
            t0 = time.monotonic()
            if member.recover(step, failure, model) is None:
                return 0
        in_flight = step
        step, _ = member.settle(model, opt, step=step, extras={})
        ugroup = dist.new_group() if a.user_group else None
        assert member.plan is not None and member.last is not None
        log("regroup", gen=member.plan.gen, world=member.plan.world_size, rank=member.rank,
            reason=member.plan.reason, step=step, in_flight=in_flight,
            healed_from=member.last.healed_from, sent_to=member.last.sent_to,
            seconds=time.monotonic() - t0, digest=state_digest(model, opt))
    member.finish(step)
    save_final(out, a.node, model, opt, step)
    log("finished", step=step, digest=state_digest(model, opt))
    return 0


# ---------------------------------------------------------------- restart
def run_restart(a: argparse.Namespace) -> int:
    out = Path(a.out)
    store = dist.TCPStore(HOST, a.port, is_master=False, use_libuv=True,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"restart/{a.until}/", store),  # type: ignore[attr-defined]
                            rank=a.rank, world_size=a.world, timeout=timedelta(seconds=60))
    net, opt = build()
    model = DDP(net)
    ckpt = out / "restart-ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    while step < a.until:
        train_step(model, opt, step, a.world, a.rank, a.steps)
        step += 1
    if a.rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "step": step}, out / "restart-ckpt.tmp")
        os.replace(out / "restart-ckpt.tmp", ckpt)
        save_final(out, f"restart-{a.until}", model, opt, step)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["inprocess", "restart"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--run", default="test")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--node", default="")
    p.add_argument("--expected", type=int, default=3)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--leave-at", type=int, default=-1)
    p.add_argument("--hold-at", type=int, default=-1)
    p.add_argument("--hold-key", default="test/join-go")
    p.add_argument("--join-gate", default="")
    p.add_argument("--moving", action="store_true")
    p.add_argument("--told-lost", action="append", default=[])  # pods, from --told-lost-at on
    p.add_argument("--told-lost-at", type=int, default=0)
    p.add_argument("--user-group", action="store_true")
    p.add_argument("--stall-at", type=int, default=-1)
    p.add_argument("--hold-budget", type=float, default=60.0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--until", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    return run_inprocess(a) if a.mode == "inprocess" else run_restart(a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
