"""Sharded, atomically committed, resumable checkpoints over a pluggable object storage."""

from elastrain_trainer.checkpoint.backends import open_storage
from elastrain_trainer.checkpoint.manager import CheckpointManager, LoadResult, SaveRequest
from elastrain_trainer.checkpoint.storage import CheckpointStorage

__all__ = ["CheckpointManager", "CheckpointStorage", "LoadResult", "SaveRequest", "open_storage"]
