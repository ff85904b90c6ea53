"""Rotary position embedding: the frequencies come from transformers (every variant its configs use:
default, linear, dynamic, yarn, llama3, ...); only the rotation of our (B, T, H, D) tensors is ours.

Positions are chosen by the cache (see docs/architecture.md), never by the model.
"""
from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half


class Rotary:
    def __init__(self, config, max_len: int | None = None, device=None):
        params = config.rope_parameters or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
        elif rope_type == "dynamic":
            # Dynamic NTK rescales with the sequence length. We fix the frequencies once per generation,
            # for the longest length it can reach, so that every cache and every level agrees on them
            # (recomputing mid-sequence would make old keys and new queries disagree). transformers takes
            # max(max_len, max_position_embeddings), and no row of a generation passes the model's
            # context, so every row of a batch gets the frequencies it gets alone.
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=max_len)
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        self.inv_freq = inv_freq.float().to(device)  # (D/2,)
        self.scale = float(scale)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions (T,), on the frequencies' device -> cos, sin, each (T, 1, D) in `dtype`, broadcasting
        over (B, T, H, D)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        cos = (emb.cos() * self.scale).to(dtype)[:, None, :]
        sin = (emb.sin() * self.scale).to(dtype)[:, None, :]
        return cos, sin

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, H, D) rotated by per-position cos, sin (T, 1, D)."""
        return x * cos + rotate_half(x) * sin
