"""RetrievalCache: the middle level's cache, a fixed budget of the full cache's keys chosen by relevance.

Rebuild (from a FullCache and the current query of each layer): split the committed keys into chunks
of `chunk_size` tokens (the last one may be partial); score each chunk per KV head by the query against
the chunk's mean key, where the query of a KV head is the sum of its group's query heads (GQA); keep
the first chunk always (attention sinks) and the top-scoring chunks up to the budget, per layer and per
KV head. Slots are filled in descending score, so the end of the buffer holds the least important.

The chunk means come from per-chunk key sums kept with this cache (cache/chunkstats.py): built once at
prefill (`observe`) and extended at each rebuild by the chunks completed since the last one, so a
rebuild reads the rows committed since the last rebuild, the partial last chunk, and the selected rows'
K/V: O(budget + new tokens) rows of each layer, not O(context), wherever the layer lives. Scores are
computed on this cache's device, where the query is.

New tokens (after a rebuild) take slots from the end backwards, replacing the least important entries
first; the engine rebuilds before they would reach the first chunk. Keys keep the rotation of their
true position (cache/base.py), so any subset is attended exactly as in the full cache: with a budget
>= the context, this cache gives the full cache's attention.

With `shared=True` ("shared" policy) one selection serves every layer and KV head: each (layer, head)'s
chunk scores, scaled by 1/sqrt(head_dim), become a softmax over chunks; their mean over layers and
heads ranks the chunks once. Why: in a small model the heads that copy a passkey sit in the lowest
layers, and the last prompt token's query there does not point at the key (the next tokens' queries
do); per-layer selection drops the key from exactly those layers, while a model-wide vote keeps the
chunks the answering layers point at everywhere (EVALUATION.md). It scores from the same statistics.

Other selection rules (Top-K, StreamingLLM, H2O: cache/policies.py) fill the same fixed budget through
`select(layer, keys, length, query, budget) -> positions (H_kv, n <= budget)` (-1 = empty, descending
importance); `select=None` is the chunk rule above. Those rules read a layer's full keys.
"""
from __future__ import annotations

import math

import torch

from ..rope import Rotary
from .base import CacheView, StaticInputs, visibility
from .chunkstats import ChunkStats
from .full import FullCache


def chunk_scores(means: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """means (C, H_kv, D) float32 chunk mean keys, query (H_q, D) -> (H_kv, C): group query . mean key."""
    n_kv, d = means.shape[1], means.shape[2]
    group_query = query.float().view(n_kv, -1, d).sum(1)  # (H_kv, D)
    return torch.einsum("chd,hd->hc", means, group_query)


def select_chunks(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """scores (H_kv, C) -> chunk ids (H_kv, min(n_keep, C)), the first chunk first, then by descending score."""
    scores = scores.clone()
    scores[:, 0] = float("inf")
    return scores.topk(min(n_keep, scores.shape[1]), dim=1).indices


def shared_votes(scores: list[torch.Tensor], head_dim: int) -> torch.Tensor:
    """Per layer (H_kv, C) scores -> (H_kv, C): every head's softmax over chunks, summed over layers and
    heads, the same for every head."""
    total = sum((s / math.sqrt(head_dim)).softmax(-1).sum(0) for s in scores)
    return total.expand(scores[0].shape[0], -1)


def chunk_positions(stats: ChunkStats, full, queries: list[torch.Tensor], L: int, budget: int, shared: bool,
                    device) -> list[torch.Tensor]:
    """The chunk rule over the first L committed tokens of `full` (anything with kv_home / read_keys, e.g.
    one row of a batched cache): per layer (H_kv, K * chunk) positions, per layer or shared; queries per
    layer (H_q, D). Reads only the rows the statistics do not cover yet; scores on `device`."""
    c = stats.chunk
    stats.truncate(L)
    scores = []
    for layer, query in enumerate(queries):
        stats.update(layer, full, L)
        scores.append(chunk_scores(stats.means(layer, full, L, device), query.to(device)))
    if shared and L > budget and scores:
        scores = [shared_votes(scores, queries[0].shape[-1])] * len(scores)
    # budget >= context keeps every chunk, the last one maybe partial (budget // c could drop one).
    n_keep = -(-L // c) if L <= budget else budget // c
    positions = []
    for s in scores:
        chunks = select_chunks(s, n_keep)  # (H_kv, K)
        pos = (chunks[:, :, None] * c + torch.arange(c, device=device)).flatten(1)  # (H_kv, K*c)
        if L <= budget:  # all chunks: drop the partial chunk's padding so the L tokens fit
            pos = pos[pos < L].view(pos.shape[0], L)
        positions.append(pos)
    return positions


class RetrievalCache(StaticInputs):
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, budget: int, chunk_size: int,
                 rotary: Rotary, dtype=torch.float32, device="cpu", select=None, shared: bool = False,
                 recompute_stats: bool = False):
        self.select = select  # None: the chunk rule; else a policies.py rule
        self.recompute_stats = recompute_stats  # no chunk sums kept for layers on `device` (placement.Plan)
        self.shared = shared  # the chunk rule with one selection for all layers and heads
        shape = (n_layers, 1, budget, n_kv, head_dim)  # per layer (B, S=budget, H_kv, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_pos = torch.full((n_layers, n_kv, budget), -1, dtype=torch.long, device=device)
        self.budget, self.chunk_size, self.rotary = budget, chunk_size, rotary
        self.length = 0
        self.base = 0  # sequence length at the last rebuild; later tokens are "new"
        self.pending = 0
        self.stats: ChunkStats | None = None  # the chunk rule's statistics of the full cache _stats_of
        self._stats_of: FullCache | None = None

    @property
    def new_tokens(self) -> int:
        return self.length - self.base

    def room(self) -> int:
        """New tokens that still fit before they would overwrite the first chunk."""
        return self.budget - self.chunk_size - self.new_tokens

    def stats_for(self, full: FullCache) -> ChunkStats:
        """The chunk statistics of `full` (allocated at first use, next to each layer's KV)."""
        if self._stats_of is not full:
            self.stats = ChunkStats.for_cache(full, self.chunk_size, self.recompute_stats)
            self._stats_of = full
        return self.stats

    def forget_rows(self, length: int) -> None:
        """The full cache was rolled back to `length` and will be written again from there (a conversation's
        next prompt): its chunk statistics above `length` no longer hold."""
        if self.stats is not None:
            self.stats.truncate(length)

    def observe(self, full: FullCache, layer: int, keys: torch.Tensor) -> None:
        """Layer-major prefill hands over a layer's keys (B, n, H_kv, D) of positions [full.length,
        full.length + n) while they are on the device: their chunk sums are taken now, not re-read later."""
        self.stats_for(full).observe(layer, keys, full.length)

    def rebuild(self, full: FullCache, queries: list[torch.Tensor]) -> None:
        """Refill from the full cache's committed tokens; queries: per layer (H_q, D), rotated."""
        L = full.length
        self.key_pos.fill_(-1)
        if self.select is None:
            positions = self._chunk_positions(full, queries, L)
        else:
            positions = [self._select(full, layer, query, L) for layer, query in enumerate(queries)]
        for layer, pos in enumerate(positions):
            self._fill(full, layer, pos, L)
        self.length = self.base = L

    def _chunk_positions(self, full: FullCache, queries: list[torch.Tensor], L: int) -> list[torch.Tensor]:
        return chunk_positions(self.stats_for(full), full, queries, L, self.budget, self.shared,
                               self.key_pos.device)

    def _select(self, full: FullCache, layer: int, query: torch.Tensor, L: int) -> torch.Tensor:
        keys = full.layer_keys(layer)  # the whole layer, wherever it lives
        pos = self.select(layer, keys[0], L, query.to(keys.device), self.budget)
        assert pos.shape[1] <= self.budget, "a select rule returned more positions than the budget"
        return pos

    def _fill(self, full: FullCache, layer: int, pos: torch.Tensor, L: int) -> None:
        """Hold the K/V at pos (H_kv, n <= budget) in slots [0, n); -1 or >= L: an empty slot."""
        valid = (pos >= 0) & (pos < L)
        idx = pos.clamp(min=0, max=L - 1).T  # (n, H_kv)
        n = idx.shape[0]
        k, v = full.gather_rows(layer, idx)  # only these rows, wherever the layer lives
        self.k[layer, :, :n] = k.to(self.k.device)
        self.v[layer, :, :n] = v.to(self.v.device)
        self.key_pos[layer, :, :n] = torch.where(valid, pos, -1).to(self.key_pos.device)

    def _slots(self, start: int, n: int) -> torch.Tensor:
        """Slots of sequence positions [start, start + n): from the end of the buffer backwards."""
        offset = torch.arange(start - self.base, start - self.base + n, device=self.key_pos.device)
        return self.budget - 1 - offset % self.budget

    def graph_key(self):
        return "retrieval"  # fixed shapes: every forward of T tokens looks the same

    def begin(self, n: int) -> None:
        self.pending = n
        device = self.key_pos.device
        pos = torch.arange(self.length, self.length + n, device=device)
        self._slot = self._static("slot", self._slots(self.length, n))  # built on the device
        cos, sin = self.rotary.cos_sin(pos, self.k.dtype)
        self._cos, self._sin = self._static("cos", cos), self._static("sin", sin)
        self.key_pos[:, :, self._slot] = pos
        mask = visibility(self.key_pos.flatten(0, 1), pos).view(
            self.key_pos.shape[0], self.key_pos.shape[1], n, self.budget)  # (layers, H_kv, T, S)
        self._mask = self._static("mask", mask)

    def update(self, layer, q, k, v):
        q = self.rotary.rotate(q, self._cos, self._sin)
        self.k[layer, :, self._slot] = self.rotary.rotate(k, self._cos, self._sin)
        self.v[layer, :, self._slot] = v
        return q, CacheView(self.k[layer], self.v[layer], self._mask[layer])

    def commit(self, n: int) -> None:
        assert 0 <= n <= self.pending
        self.length += n
        self.pending = 0

    def truncate(self, length: int) -> None:
        assert self.base <= length <= self.length, "cannot roll back past a rebuild"
        self.length = length
