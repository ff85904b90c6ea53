"""The verifier's forward computed row by row: each new token of each row gets exactly the arithmetic a
one-token forward at its position, of that row's prompt alone, would get, while the cache is still filled
(and an offloaded layer still streamed from host memory) once per forward.

Why: a forward over T tokens and T forwards over one token round differently (a matrix product with 7
rows may take another kernel or reduction order than one with 1 row; attention over a masked block is
not attention over the visible prefix): ~2e-6 in float32 and ~1.5e-2 in bfloat16 on a tiny model
(tests/engine/test_rowwise.py). A greedy token then differs from plain decoding's wherever the target's top two
logits are closer than that. With this runner on the full-cache level
(`deterministic=True`) every logit the verifier computes is bit for bit the one plain decoding of that
prompt alone computes, so greedy TriForce equals greedy `ar` token for token in any dtype, on the same
device and kernels, for one prompt or for each row of a batch.

Same shapes, same kernels: a span of one row's real tokens, as plain decoding of that prompt alone would
feed them (one token at a time where logits are wanted; a row's whole chunk in a prefill), goes through
every linear layer, norm and MLP as a (1, n, hidden) input, and attends to its own row's keys up to its
last position (causally within the span, without a mask for one token), as a forward of that row alone at
those positions does. Padding of rows of different lengths enters no computation: its K/V are zeros,
written beyond the row's length and never visible (docs/architecture.md, rows). Elementwise steps (RoPE,
residual adds) are the same per element whatever the batch. The cost: each weight is read once per token
(per row and chunk in a prefill) instead of once per forward, which is small beside streaming the KV
cache from host memory at long context and large on chip (`tforce bench --deterministic` measures it).
The network's code (model/network.py) is used as it is; only the order of the calls differs, so this file
must follow model/network.py's forward.
"""
from __future__ import annotations

import torch

from ..model.attention import attend
from ..cache.base import CacheView, visibility
from ..cache.full import FullCache

Span = tuple[int, int, int]  # (row, first, end): tokens [first, end) of the forward's T, all real


def spans(counts: list[int], per_token: bool) -> list[Span]:
    """Each row's real tokens as plain decoding of that row alone feeds them: one span per token (logits
    wanted: decoding), or the row's whole count (a prefill chunk)."""
    if per_token:
        return [(b, t, t + 1) for b, n in enumerate(counts) for t in range(n)]
    return [(b, 0, n) for b, n in enumerate(counts) if n]


class RowwiseRunner:
    """runner(ids, last_n, counts, prefill) with the contract of model(ids, cache, last_n) after
    cache.begin(T), for a cache whose slot s holds position s (FullCache, OffloadedCache); counts: each row's
    real tokens (the rest of its T is padding), and the result is each row's logits after its last last_n
    real tokens. prefill: a prefill chunk (last_n 0 or 1): each row's tokens as one span, as the row's
    prefill alone feeds them, with last_n=1 the logits after the row's last token (a row feeding nothing:
    the head of a zero state, never used)."""

    counted = True  # node.Node passes each row's real count and takes (B, last_n, V) as it comes

    def __init__(self, model, cache):
        assert isinstance(cache, FullCache), "row-wise verification needs a cache whose slots are positions"
        self.model, self.cache = model, cache

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, last_n: int | None, counts: list[int] | None = None,
                 prefill: bool = False):
        B, T = ids.shape
        counts = [T] * B if counts is None else list(counts)
        if last_n == 0 and B == 1:  # one row's prefill: the plain forward, exactly as plain decoding prefills
            return self.model(ids, self.cache, last_n=0)
        body, last = self.model.model, T if last_n is None else last_n
        pieces = spans(counts, per_token=last > 0 and not prefill)
        xs = [body.embed_tokens(ids[b:b + 1, s:e]) for b, s, e in pieces]  # each (1, e - s, hidden)
        starts = list(self.cache.lengths[:B])
        for layer in body.layers:
            xs = layer_rows(layer, xs, pieces, self.cache, starts, T)
        if last == 0:
            return None
        if prefill:
            ends = {b: x[:, -1:] for x, (b, _, _) in zip(xs, pieces)}
            blank = torch.zeros_like(next(iter(ends.values())))
            return self.heads([ends.get(b, blank) for b in range(B)])
        keep = [[] for _ in range(B)]
        for x, (b, s, _) in zip(xs, pieces):
            if s >= counts[b] - last:
                keep[b].append(self.model.head(x))
        return torch.cat([torch.cat(row, dim=1) for row in keep])  # (B, last, V)

    def heads(self, hidden: list[torch.Tensor]) -> torch.Tensor:
        """Each row's logits (B, 1, V) from its last position's hidden state (1, 1, hidden): the head run on
        each row apart, as that row's prefill alone runs it (node.Node.next_of, the prefill above)."""
        return torch.cat([self.model.head(h) for h in hidden])


def layer_rows(layer, xs: list[torch.Tensor], pieces: list[Span], cache, starts: list[int], T: int
               ) -> list[torch.Tensor]:
    """One decoder layer over each span's hidden states xs[i] (1, n, hidden), each as a forward of those
    tokens alone at positions starts[b] + [first, end); the cache takes all rows' K/V (B, T) in one update,
    padding as zeros."""
    attn = layer.self_attn
    parts = [attn.qkv(layer.input_layernorm(x)) for x in xs]
    q, k, v = (_assemble([p[i] for p in parts], pieces, len(starts), T) for i in range(3))
    q, view = cache.update(attn.layer, q, k, v)  # writes every row's K/V once
    out = []
    for x, (b, s, e) in zip(xs, pieces):
        first, end = starts[b] + s, starts[b] + e
        mask = None
        if e - s > 1:  # causal within the span, as a uniform FullCache.begin masks a chunk
            mask = visibility(torch.arange(end, device=q.device)[None], torch.arange(first, end, device=q.device))
        visible = CacheView(view.k[b:b + 1, :end], view.v[b:b + 1, :end], mask, causal=True)
        a = attend(q[b:b + 1, s:e].contiguous(), visible)  # (1, n, H_q, D)
        x = x + attn.o_proj(a.reshape(1, e - s, -1))
        out.append(x + layer.mlp(layer.post_attention_layernorm(x)))
    return out


def _assemble(parts: list[torch.Tensor], pieces: list[Span], B: int, T: int) -> torch.Tensor:
    """Spans' (1, n, H, D) tensors into one (B, T, H, D), zeros where a row has padding."""
    if B == 1 and len(parts) == T:  # one row, every token its own span: in order
        return torch.cat(parts, dim=1)
    out = parts[0].new_zeros(B, T, *parts[0].shape[2:])
    for x, (b, s, e) in zip(parts, pieces):
        out[b, s:e] = x[0]
    return out


def prefill_rows(layer, x: torch.Tensor, a: int, counts: list[int], cache, starts: list[int]) -> None:
    """Layer-major prefill (prefill.py), row by row: x (B, N, hidden), each row's counts[b] tokens from
    position a through `layer` in place, as token-major prefill of that row alone feeds them."""
    pieces = spans(counts, per_token=False)
    xs = [x[b:b + 1, a:a + n].contiguous() for b, _, n in pieces]
    for (b, _, n), y in zip(pieces, layer_rows(layer, xs, pieces, cache, starts, max(counts))):
        x[b:b + 1, a:a + n] = y
