"""GPT presets and their parameter counts: torch-free, so `estimate` runs anywhere."""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTShape:
    """Architecture of one preset."""

    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int = VOCAB_SIZE


PRESETS: dict[str, GPTShape] = {
    "gpt-tiny": GPTShape(n_layer=2, n_head=4, d_model=64),
    "gpt-small": GPTShape(n_layer=4, n_head=4, d_model=256),
    "gpt-100m": GPTShape(n_layer=14, n_head=12, d_model=768),
    "gpt-350m": GPTShape(n_layer=24, n_head=16, d_model=1024),
    "gpt-1b": GPTShape(n_layer=24, n_head=16, d_model=2048),
}


def count_parameters(shape: GPTShape, seq_len: int) -> int:
    """Parameter count without building the model (used by the memory estimate)."""
    d = shape.d_model
    per_block = 12 * d * d + 13 * d  # qkv+proj+mlp weights and biases, two LayerNorms
    embeddings = shape.vocab_size * d + seq_len * d
    return shape.n_layer * per_block + embeddings + 2 * d + d * shape.vocab_size
