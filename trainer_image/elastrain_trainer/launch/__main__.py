"""Entry of elastrain's launcher: torchrun with the agent patches of agent.py applied.

    python -m elastrain_trainer.launch [torchrun options] -m elastrain_trainer
    python -m elastrain_trainer.launch [torchrun options] train.py [script args]

Worker pods run this (the operator's default command; a TrainingJob's `command` may name it
too), and so does every local agent (cluster.py). Options and PET_* variables are torchrun's.
"""

from __future__ import annotations

import sys

from elastrain_trainer.launch.agent import (
    WorkerCrashed,
    patch_crash_budget,
    patch_restart_timeout,
    report_crash,
)


def main(argv: list[str] | None = None) -> int:
    patched = patch_restart_timeout() and patch_crash_budget()
    if not patched:
        print("elastrain launch: torch's elastic agent changed; running plain torchrun",
              file=sys.stderr)
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except WorkerCrashed as crash:
        report_crash(str(crash))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
