"""elastrain trainer: elastic, preemption-safe PyTorch training (the in-image trainer).

Entry point: `python -m elastrain_trainer` under torchrun (see __main__.py). As a library:
    elastrain_trainer.estimate(config, world_size)            memory per rank (torch-free)
    elastrain_trainer.checkpoint.CheckpointManager            sharded async checkpoints
    elastrain_trainer.signals.StopAgreement                   SIGTERM -> save -> exit
    elastrain_trainer.launch.local.run_local(...)             local multi-agent runs
"""

from elastrain_trainer.config import TrainerConfig
from elastrain_trainer.estimate import MemoryEstimate, estimate

__all__ = ["MemoryEstimate", "TrainerConfig", "estimate"]
