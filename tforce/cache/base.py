"""The cache protocol and the pieces every cache shares (CacheView, StaticInputs, visibility).

The tensor layout (K/V per layer as (B, S, H_kv, D), one row per prompt), the row rule (left-aligned
rows, per-row `lengths`, padding only at a row's end, the fast path for rows of one length), the
protocol (begin / update / commit / truncate), the position rule and the visibility rule are stated
once, in docs/architecture.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class CacheView:
    k: torch.Tensor  # (B, S, H_kv, D), rotated
    v: torch.Tensor  # (B, S, H_kv, D)
    # bool (H, T, S) for every row, or (B, H, T, S) one per row (H: 1 or H_kv); True = visible; None = all
    mask: torch.Tensor | None
    # True when the mask is exactly "the T queries are the last T keys, causally" (bottom-right
    # aligned): then flash-attn's causal kernel computes the same thing without a mask.
    causal: bool = False
    # Rows of different lengths in the full and streaming caches: (B,) int32 on the view's device, row b's
    # visible keys are its first seqlens[b] slots and its T queries the last T of them, causally (the mask
    # says exactly that): flash-attn's kvcache kernel takes it as cache_seqlens instead of the mask.
    seqlens: torch.Tensor | None = None


@runtime_checkable
class KVCache(Protocol):
    """What the engine asks of every cache kind (engine/node.Node, engine/session.py, engine/decode.py;
    docs/architecture.md, "Protocol"); tests/cache/test_caches.py checks each kind a session builds against it."""

    rows: int  # live rows (prompts)
    lengths: list[int]  # committed tokens per row

    @property
    def length(self) -> int: ...  # the committed length the live rows share

    # counts: each fed row's real tokens of the n. A cache with `subsets = True` (streaming, retrieval) also
    # takes rows: the live rows this forward feeds; the others sit it out, untouched (commit gives them 0).
    def begin(self, n: int, counts: list[int] | None = None) -> None: ...

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, CacheView]: ...

    def commit(self, counts: int | list[int]) -> None: ...

    def truncate(self, lengths: int | list[int]) -> None: ...

    def keep(self, rows: list[int]) -> None: ...  # compaction: live row i becomes rows[i]


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
