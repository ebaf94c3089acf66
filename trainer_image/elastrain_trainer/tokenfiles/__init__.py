"""Token files (nanoGPT `train.bin`, llm.c gpt-2 and llama-3 shards; one file, a glob or a list)
read by global sample index from file:// or
s3://: `formats` parses and validates (pure), `sources` reads byte ranges, `dataset` windows,
caches and prefetches them."""

from elastrain_trainer.tokenfiles.dataset import TokenFileDataset, open_token_dataset
from elastrain_trainer.tokenfiles.formats import FORMATS, TokenFileError, TokenLayout

__all__ = ["FORMATS", "TokenFileDataset", "TokenFileError", "TokenLayout", "open_token_dataset"]
