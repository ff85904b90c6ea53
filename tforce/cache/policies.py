"""Selection rules for the middle level's fixed-budget cache (RetrievalCache(select=...)).

Every rule answers the same question at a rebuild: given one layer's committed keys, the current
query and the budget, which sequence positions should the cache hold, per KV head? The cache then
holds exactly those keys (at their true rotations), so the rules differ only in *which* tokens, never
in how they are attended; the output stays exact whatever the rule (speculative sampling).

    select(layer, keys, length, query, budget, row) -> positions (H_kv, n), n <= budget, -1 = empty slot

keys (S >= length, H_kv, D) rotated, query (H_q, D) rotated (the last committed token's), both row `row`'s
(the cache row selected for: a batch's rows are different prompts; only a rule with per-prompt state, H2O,
reads it). Positions come in descending importance: tokens generated after a rebuild overwrite the end of
the buffer first. A rule with per-row state has `keep(rows)`: RetrievalCache.keep tells it which rows stay.

- "retrieval" (ours, TriForce): chunk-mean keys scored by the group query, first chunk always kept
  (the RetrievalCache default; `select=None`).
- "shared": the chunk rule with one selection for every layer and KV head (the mean of their
  softmaxed chunk scores; `RetrievalCache(shared=True)`, `select=None`).
  Both score chunks from per-chunk key sums kept with the cache (cache/chunkstats.py), so a rebuild
  reads O(budget + new tokens) rows of each layer. The rules below are evaluation baselines: at every
  rebuild they read each row's committed keys of every layer (`FullCache.read_keys`; from host memory for
  an offloaded layer), O(context) per layer.
- "topk": the exact highest-attention tokens of the current query, per layer and KV head, attention
  probabilities summed over the GQA group's query heads. An oracle upper bound for any selection of
  `budget` single tokens for this query (it reads every key, as the full cache does).
- "streaming": StreamingLLM's choice, sinks + the most recent window (here at true positions, like
  every rule in this file, so only the selection differs from the others).
- "h2o": Heavy-Hitter Oracle: per layer and KV head, the tokens with the largest attention
  accumulated over all prompt queries (group-summed), plus a recent window of budget // 2. The
  accumulated attention needs every prompt query: `prepare(model, prompt_ids)` runs one extra
  forward pass over the prompt recording the rotated queries, then computes softmax(QK^T) per layer
  in blocks of queries: O(layers * H_q * L^2 * D) time and O(block * H_q * L) memory on top of a
  prefill. Fine for evaluation at a few thousand tokens; not a production path at 128K (H2O itself
  accumulates during prefill inside the attention kernel, which this engine's kernels do not expose).
  Tokens after the prompt have no accumulated score (0); the recent window covers them. In a batch each
  row's scores are its own prompt's (`prepare(..., row=b)`, one pass per row), so a row selects what it
  would alone; `keep(rows)` moves them with their rows when finished rows are compacted away.
"""
from __future__ import annotations

import math

import torch

from .full import FullCache

POLICIES = ("retrieval", "shared", "topk", "streaming", "h2o")


def group_attention(keys: torch.Tensor, length: int, query: torch.Tensor) -> torch.Tensor:
    """keys (S, H_kv, D), query (H_q, D) -> (H_kv, length): softmax(q.k / sqrt(D)) per query head,
    summed over each KV head's group of query heads."""
    n_kv, d = keys.shape[1], keys.shape[2]
    k = keys[:length].float()  # (L, H_kv, D)
    q = query.float().view(n_kv, -1, d)  # (H_kv, G, D)
    logits = torch.einsum("hgd,lhd->hgl", q, k) / math.sqrt(d)
    return logits.softmax(-1).sum(1)  # (H_kv, L)


def _all(n_kv: int, length: int, device) -> torch.Tensor:
    return torch.arange(length, device=device).expand(n_kv, length).clone()


class TopK:
    """The exact top-`budget` tokens by the current query's group-summed attention."""

    def __call__(self, layer, keys, length, query, budget, row):
        if length <= budget:
            return _all(keys.shape[1], length, keys.device)
        scores = group_attention(keys, length, query.to(keys.device))
        return scores.topk(budget, dim=1).indices  # sorted, descending


class Streaming:
    """Attention sinks (the first `sinks` tokens) and the most recent budget - sinks tokens."""

    def __init__(self, sinks: int):
        self.sinks = sinks

    def __call__(self, layer, keys, length, query, budget, row):
        n_kv, device = keys.shape[1], keys.device
        if length <= budget:
            return _all(n_kv, length, device)
        sinks = min(self.sinks, budget - 1)
        recent = torch.arange(length - 1, length - 1 - (budget - sinks), -1, device=device)  # newest first
        pos = torch.cat([torch.arange(sinks, device=device), recent])
        return pos.expand(n_kv, budget).clone()


class _Recorder(FullCache):
    """A FullCache that keeps every forward's rotated queries (per layer, a list of (T, H_q, D))."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.all_queries: list[list[torch.Tensor]] = [[] for _ in range(self.n_layers)]

    def update(self, layer, q, k, v):
        q, view = super().update(layer, q, k, v)
        self.all_queries[layer].append(q[0].detach())
        return q, view


def accumulated_attention(keys: torch.Tensor, queries: torch.Tensor, block: int = 256) -> torch.Tensor:
    """keys (L, H_kv, D), queries (L, H_q, D) of the same L positions (rotated) -> (H_kv, L): for each
    key, the attention it receives summed over all (causal) queries and the group's query heads."""
    L, n_kv, d = keys.shape
    k = keys.float()
    out = torch.zeros(n_kv, L, device=keys.device)
    for s in range(0, L, block):
        q = queries[s:s + block].float()  # (T, H_q, D)
        T = q.shape[0]
        q = q.view(T, n_kv, -1, d)  # (T, H_kv, G, D)
        seen = s + T  # the keys this block's queries can see (causal): half the work of all L on average
        logits = torch.einsum("thgd,lhd->hgtl", q, k[:seen]) / math.sqrt(d)  # (H_kv, G, T, seen)
        visible = torch.arange(seen, device=keys.device)[None] <= torch.arange(s, seen, device=keys.device)[:, None]
        probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        out[:, :seen] += probs.sum((1, 2))
    return out


class H2O:
    """Heavy hitters by attention accumulated over the prompt's queries, plus a recent window."""

    def __init__(self, recent_frac: float = 0.5):
        self.recent_frac = recent_frac
        # per cache row (its own prompt's), per layer (H_kv, L_prompt); None: not prepared
        self.scores: list[list[torch.Tensor] | None] = []

    def prepare(self, model, prompt_ids: torch.Tensor, row: int = 0, chunk: int = 512) -> None:
        """One recording pass over prompt_ids, cache row `row`'s prompt; accumulate attention per layer (see
        the module doc)."""
        p = next(model.parameters())
        from .rope import Rotary

        n = len(prompt_ids)
        cache = _Recorder(model.config.num_hidden_layers, model.n_kv_heads, model.head_dim, max(n, 1),
                          Rotary(model.config, max_len=max(n, 1), device=p.device), dtype=p.dtype, device=p.device)
        with torch.no_grad():
            for s in range(0, n, chunk):
                ids = prompt_ids[s:s + chunk]
                cache.begin(len(ids))
                model(ids[None].to(p.device), cache, last_n=0)
                cache.commit(len(ids))
            scores = [accumulated_attention(cache.k[layer, 0, :n], torch.cat(qs)) if qs
                      else torch.zeros(model.n_kv_heads, 0)
                      for layer, qs in enumerate(cache.all_queries)]
        self.scores += [None] * (row + 1 - len(self.scores))
        self.scores[row] = scores

    def keep(self, rows: list[int]) -> None:
        """The cache kept only these rows (increasing), moved to the front: each row's scores go with it."""
        self.scores = [self.scores[i] if i < len(self.scores) else None for i in rows]

    def __call__(self, layer, keys, length, query, budget, row):
        n_kv, device = keys.shape[1], keys.device
        if length <= budget:
            return _all(n_kv, length, device)
        assert row < len(self.scores) and self.scores[row] is not None, \
            "H2O.prepare(model, prompt, row) must run before the row's first rebuild"
        n_recent = max(1, int(budget * self.recent_frac))
        n_heavy = budget - n_recent
        start = length - n_recent
        score = torch.zeros(n_kv, start, device=device)
        known = self.scores[row][layer].to(device)[:, :start]
        score[:, :known.shape[1]] = known
        heavy = score.topk(n_heavy, dim=1).indices  # (H_kv, n_heavy), descending
        recent = torch.arange(length - 1, start - 1, -1, device=device).expand(n_kv, n_recent)
        return torch.cat([heavy, recent], dim=1)


def make_select(policy: str, sinks: int = 4):
    """The select rule for a policy name; None means RetrievalCache's own chunk rule."""
    if policy in ("retrieval", "shared"):
        return None
    if policy == "topk":
        return TopK()
    if policy == "streaming":
        return Streaming(sinks)
    if policy == "h2o":
        return H2O()
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
