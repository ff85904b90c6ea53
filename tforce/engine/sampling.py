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


class RowGenerators:
    """One random generator per live row (engine/joining.py: each request's own seed), where a single
    torch.Generator draws for every row at once: each row then draws as its prompt alone draws, from its own
    generator, in the same order and shapes (a row's draws do not depend on the other rows')."""

    def __init__(self, gens=()):
        self.gens = list(gens)

    def __len__(self) -> int:
        return len(self.gens)

    def pick(self, rows) -> "RowGenerators":
        return RowGenerators([self.gens[b] for b in rows])

    def keep(self, live: list[int]) -> None:
        """Only the listed live rows stay, moved to the front (Session.keep)."""
        self.gens = [self.gens[i] for i in live]

    def append(self, gen: torch.Generator) -> None:
        self.gens.append(gen)

    def rand(self, k: int, device, lengths: list[int] | None = None) -> torch.Tensor:
        """(R, k) uniforms, row i's from its generator as torch.rand(1, lengths[i]) alone (None: k each),
        the rest of its row ones."""
        u = torch.ones(len(self.gens), k, device=device)
        for i, (g, m) in enumerate(zip(self.gens, [k] * len(self.gens) if lengths is None else lengths)):
            u[i:i + 1, :m] = torch.rand(1, m, generator=g, device=device)
        return u


def pick(gen, rows):
    """The generator(s) of the listed live rows: a single torch.Generator stays as it is."""
    return gen.pick(rows) if isinstance(gen, RowGenerators) else gen


def sample(probs: torch.Tensor, gen, greedy: bool = False) -> torch.Tensor:
    """probs (..., V) -> token ids (...), drawn on the probs' device; the ids stay there. greedy: the
    distributions are one-hot (temperature 0, to_probs), so the draw is their argmax: taken directly, without
    multinomial's pass over the vocabulary (a tenth of a greedy batch's decode time on the CPU, BENCHMARKS.md).
    gen: a torch.Generator, or RowGenerators with one per row of probs (its first dimension)."""
    if greedy:
        return probs.argmax(-1)
    if isinstance(gen, RowGenerators):
        assert len(gen) == probs.shape[0]
        return torch.stack([sample(probs[i:i + 1], g)[0] for i, g in enumerate(gen.gens)])
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).view(probs.shape[:-1])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) row-wise; where p - q has no positive mass (p == q), p itself."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)
