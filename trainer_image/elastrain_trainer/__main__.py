# ruff: noqa: E501 - the torchrun line below is meant to be copied whole
"""Entry point of the built-in trainer. Run one agent per node with:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun \\
        --nnodes=1:4 --nproc-per-node=1 --max-restarts=1000 --monitor-interval=0.5 \\
        --rdzv-backend=c10d --rdzv-endpoint=$STORE_HOST:29400 --rdzv-id=$JOB_UID \\
        --rdzv-conf=is_host=false,last_call_timeout=1,join_timeout=600,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        -m elastrain_trainer [--steps N --checkpoint-uri s3://bucket/prefix --resume-from URI ...]

(every torchrun option above can come from PET_* variables instead; the trainer reads the
ELASTRAIN_* variables documented in config.py, and a flag overrides its variable).
"""

from __future__ import annotations

import os
import sys

from elastrain_trainer.config import TrainerConfig


def main(argv: list[str] | None = None) -> int:
    """Train; a ValueError of the trainer's (invalid settings, unreadable data, a vocabulary
    too small) is a configuration error that guard_main reports (faults.is_configuration_error)."""
    cfg = TrainerConfig.from_env(os.environ, sys.argv[1:] if argv is None else argv)
    from elastrain_trainer.train import run

    return run(cfg)


if __name__ == "__main__":
    from elastrain_trainer.faults import guard_main

    # A lost peer exits EXIT_RESTART (restart in place, uncounted); a configuration error exits
    # EXIT_CONFIG and fails the job; a crash exits 1 with its error recorded for the launcher,
    # which counts it (elastrain_trainer.launch).
    code = guard_main(main)
    sys.stdout.flush()
    sys.stderr.flush()
    # A background upload blocked on a dead peer must not keep a failed worker alive:
    # torchrun restarts the group only once this process is gone.
    os._exit(code)
