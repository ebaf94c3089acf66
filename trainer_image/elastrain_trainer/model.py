"""The built-in GPT: a small pre-norm decoder-only transformer over bytes (vocab 256)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from elastrain_trainer.presets import PRESETS, VOCAB_SIZE, GPTShape


class Block(nn.Module):
    """Attention + MLP with residuals; the unit that FSDP shards and checkpointing recomputes."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        d = shape.d_model
        self.n_head = shape.n_head
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))
        return out


class GPT(nn.Module):
    """Token + position embeddings, `n_layer` blocks, final norm, untied LM head."""

    def __init__(self, shape: GPTShape, seq_len: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab_size, shape.d_model)
        self.wpe = nn.Embedding(seq_len, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(name: str, seq_len: int, vocab_size: int = VOCAB_SIZE) -> GPT:
    """The preset `name` for sequences of up to `seq_len` tokens of a `vocab_size` vocabulary."""
    return GPT(dataclasses.replace(PRESETS[name], vocab_size=vocab_size), seq_len)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the autocast dtype."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
