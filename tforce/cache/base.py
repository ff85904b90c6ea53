"""The one tensor layout, the position rule, and the cache protocol.

Layout (the only one in tforce): keys and values are stored per layer as (B, S, H_kv, D), batch first,
then sequence slots, then KV heads, then head dimension; the layout flash-attn's kvcache API takes.
Fresh projections arrive as (B, T, H, D). The single-prompt caches (full, offload, retrieval,
streaming) hold B = 1; the batched caches (cache/batched.py) hold one row per prompt.

Rows of different lengths (cache/batched.py). Each row is left-aligned: row b's token at sequence
position s sits in slot s (the streaming cache: in slot s for a sink, else sinks + s - offset[b]),
so a row never holds padding tokens before its text. `lengths` (B,) counts each row's committed
tokens. A forward feeds T tokens to every row at once, row b's at positions [lengths[b],
lengths[b] + T); a row with fewer real tokens to feed is padded at its END and commits only its real
count (commit(counts), counts (B,)), so its padding lands beyond its length, is never visible to a
real token (they come first) and is overwritten by the row's next forward before any query can see it.
The view is the slots [0, max(lengths) + T) of every row, with a mask (B, 1, T, S) that hides each
row's unused tail: slot s is visible to row b's query t iff s <= lengths[b] + t (the visibility rule
below, per row). RoPE positions are per row (lengths[b] + t). Rows that finish are compacted away
(keep(rows)): the remaining rows move to the front, so a finished row costs no further work.

Protocol. A forward of T new tokens is `cache.begin(T)`, then per layer
`q, view = cache.update(layer, q, k, v)`, then `cache.commit(n)` to keep the first n of the T tokens.
`truncate(length)` drops committed tokens from the end (a rejected speculation). `length` is the
number of committed tokens of the sequence that the cache represents (some caches keep only part
of them, but positions always count the whole sequence).

Position rule. The cache, not the model, applies RoPE, because the rule differs by cache:
- FullCache and RetrievalCache: a token is rotated by its true position in the sequence, once, when
  it is written; queries likewise. Selecting a subset of keys keeps their rotations.
- StreamingCache: keys are stored un-rotated and rotated by their slot in the view at each forward
  (StreamingLLM's rule), so a small draft with a short trained context never sees positions beyond
  sinks + window + new tokens.

Visibility rule (every cache): key at sequence position s is visible to the query at position p iff
0 <= s <= p. Slots that hold nothing carry s = -1. Stale slots left by a rejected speculation carry
positions >= the next query's, so they are invisible until overwritten.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class CacheView:
    k: torch.Tensor  # (B, S, H_kv, D), rotated
    v: torch.Tensor  # (B, S, H_kv, D)
    # bool (1 or H_kv, T, S), or (B, 1, T, S) with one per row; True = visible; None = all visible
    mask: torch.Tensor | None
    # True when the mask is exactly "the T queries are the last T keys, causally" (bottom-right
    # aligned): then flash-attn's causal kernel computes the same thing without a mask.
    causal: bool = False


class KVCache(Protocol):
    length: int

    def begin(self, n: int) -> None: ...

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, CacheView]: ...

    def commit(self, n: int) -> None: ...

    def truncate(self, length: int) -> None: ...


class StaticInputs:
    """For caches whose forwards may be replayed from a CUDA graph (graphs.py).

    begin() runs eagerly and stores what update() reads (positions, slots, cos/sin, masks) through
    `_static`, which keeps one buffer per name and shape and copies new values into it. A graph
    captured over update() therefore reads fresh values at every replay. `graph_key()` names the
    shapes a forward will have, or None while they still change from step to step (no capture then).
    """

    def _static(self, name: str, value: torch.Tensor) -> torch.Tensor:
        buffers = self.__dict__.setdefault("_buffers", {})
        key = (name, tuple(value.shape), value.dtype, value.device)
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = value.clone()
        else:
            buf.copy_(value)
        return buf

    def graph_key(self):
        return None


def visibility(key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """key_pos (H, S) sequence positions (-1 = empty), query_pos (T,) -> bool (H, T, S)."""
    k = key_pos[:, None, :]
    return (k >= 0) & (k <= query_pos[None, :, None])
