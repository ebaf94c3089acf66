"""Entry of elastrain's launcher: torchrun with the agent patches of agent.py applied.

    python -m elastrain_trainer.launch [torchrun options] -m elastrain_trainer
    python -m elastrain_trainer.launch [torchrun options] train.py [script args]

Worker pods run this (the operator's default command; a TrainingJob's `command` may name it
too), and so does every local agent (cluster.py). Options and PET_* variables are torchrun's.
A torch whose agent internals changed stops the launcher with a message naming the hook and the
tested torch versions (exit code 1, also in the termination message); ELASTRAIN_PLAIN_TORCHRUN=1
runs plain torchrun instead, without the crash budget and the long restart saves.
"""

from __future__ import annotations

import os
import sys

from elastrain_trainer.faults import CRASH_PREFIX
from elastrain_trainer.launch.agent import (
    WorkerCrashed,
    patch_crash_budget,
    patch_restart_timeout,
    report_crash,
)
from elastrain_trainer.private_hooks import PLAIN_TORCHRUN_ENV, MissingPrivateHook


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(PLAIN_TORCHRUN_ENV) == "1":
        print(f"elastrain launch: {PLAIN_TORCHRUN_ENV}=1: plain torchrun; a worker's crash "
              "restarts in place up to --max-restarts and a restart SIGKILLs its workers "
              "after 30 s", file=sys.stderr, flush=True)
    else:
        try:
            patch_restart_timeout()
            patch_crash_budget()
        except MissingPrivateHook as e:
            report_crash(f"{CRASH_PREFIX}launcher: {e} (or set {PLAIN_TORCHRUN_ENV}=1 to run "
                         "plain torchrun without these patches)")
            return 1
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except WorkerCrashed as crash:
        report_crash(str(crash))
        return 1
    except MissingPrivateHook as e:  # found only once the agent exists (agent.py)
        report_crash(f"{CRASH_PREFIX}launcher: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
