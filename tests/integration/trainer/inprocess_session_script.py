"""A BYO script on the Session API, unchanged for in-process recovery: it reads env.rank and
env.world_size inside the loop (the README's shape). Run as a real process per node with
ELASTRAIN_RECOVERY=inProcess (test_inprocess_session.py); writes <out>/<node>.jsonl."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root
from elastrain_trainer.api import Session, init_distributed, run
from elastrain_trainer.inprocess.transfer import state_digest
from tests.integration.trainer.inprocess_worker import build, train_step


def main() -> None:
    out, node = Path(os.environ["TEST_OUT"]), os.environ["ELASTRAIN_NODE_ID"]
    log = (out / f"{node}.jsonl").open("a", buffering=1)

    def record(event: str, **fields: object) -> None:
        log.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time(),
                              **fields}) + "\n")

    env = init_distributed()
    net, optimizer = build()
    model = DDP(net)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.01 * s))
    with Session(model=model, optimizer=optimizer, scheduler=scheduler) as session:
        record("entered", step=session.step, rank=env.rank, world=env.world_size,
               digest=state_digest(model, optimizer))
        body_sleep = float(os.environ.get("TEST_BODY_SLEEP_SECONDS", "0"))
        signal_at = {int(v): s for s, v in (("SIGKILL", os.environ.get("TEST_SIGKILL_AT")),
                                            ("SIGTERM", os.environ.get("TEST_SIGTERM_AT")))
                     if v is not None}
        for step in session.steps():
            if step in signal_at:  # at the start of this step's body, where the peers are too
                os.kill(os.getpid(), getattr(signal, signal_at.pop(step)))
            time.sleep(body_sleep)  # a lost peer is then seen in backward(), not in steps()
            loss = train_step(model, optimizer, step, env.world_size, env.rank,
                              session.total_steps)
            scheduler.step()
            record("step", step=step + 1, rank=env.rank, world=env.world_size)
            session.report(loss=loss)
    record("finished", step=session.step, digest=state_digest(model, optimizer),
           scheduler_epoch=scheduler.last_epoch)


if __name__ == "__main__":
    run(main)
