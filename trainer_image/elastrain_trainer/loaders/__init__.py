"""Data loading that stays exact when the world changes: samplers split over the Session's
current world and continued from its position (positions: the arithmetic; sampler: the
sampler; loader: a DataLoader's passes; tracking: the loaders a script built)."""

from elastrain_trainer.loaders.sampler import ElasticSampler
from elastrain_trainer.loaders.tracking import StaleBatchError, install, tracker

__all__ = ["ElasticSampler", "StaleBatchError", "install", "tracker"]
