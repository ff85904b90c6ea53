"""The target distribution and draws from it.

`to_probs` defines the distribution every level samples from and is verified against: temperature,
then top-k, then top-p (nucleus), renormalised. Temperature 0 is argmax as a one-hot distribution, so
greedy decoding is the same speculative algorithm with deterministic outcomes (no division by zero).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import Sampling


def to_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits (T, V) -> probs (T, V), float32."""
    logits = logits.float()
    if s.greedy:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if s.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= s.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator, greedy: bool = False) -> torch.Tensor:
    """probs (..., V) -> token ids (...), drawn on the probs' device; the ids stay there. greedy: the
    distributions are one-hot (temperature 0, to_probs), so the draw is their argmax: taken directly, without
    multinomial's pass over the vocabulary (a tenth of a greedy batch's decode time on the CPU, BENCHMARKS.md)."""
    if greedy:
        return probs.argmax(-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).view(probs.shape[:-1])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) row-wise; where p - q has no positive mass (p == q), p itself."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)
