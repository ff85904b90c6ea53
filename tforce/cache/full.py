"""FullCache: every token's K/V at its own position, one row per sequence; the verifier's cache and the
oracle for the others.

Rows of one length (always so for one row) take the fast path: the new tokens are written as one block and
the view is contiguous and causal (flash-attn's kernel applies; no mask for one new token). Rows of
different lengths write each row at its own positions and carry a per-row mask (the row rule of
docs/architecture.md).

Like the retrieval rebuilds need, the cache keeps each row's rotated queries of the last forward that fed
the row real tokens (`query_at`). With one row they are the forward's own tensors (no copy); with several,
each row's are copied out, so a row's queries never keep a whole batch's forward alive.
"""
from __future__ import annotations

import torch

from ..errors import TforceError
from .rope import Rotary
from ..transfer import to_device
from .base import CacheView, visibility
from .rows import Rows, per_row, rotation


class FullCache(Rows):
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int, rotary: Rotary,
                 dtype=torch.float32, device="cpu", rows: int = 1):
        shape = (n_layers, rows, capacity, n_kv, head_dim)  # per layer (B, S, H_kv, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.rotary, self.n_layers = capacity, rotary, n_layers
        self._init_rows(rows)
        self._fresh: dict[int, torch.Tensor] = {}  # layer -> this forward's rotated queries (B, T, H_q, D)
        # per row: (first position, count, per layer (1, >= count, H_q, D) queries) or None
        self.row_queries: list[tuple[int, int, list[torch.Tensor]] | None] = [None] * rows

    # begin takes the rows a forward feeds (Node.fill_row: a row joining a running batch is prefilled
    # alone), but a ragged prefill or verification feeds every row (padding where a row has nothing), so
    # that its forwards, and their rounding, are those of the layer-major prefill (prefill.py)
    subsets = False
    alone_rows = True  # Node.fill_row feeds one row alone

    def begin(self, n: int, counts: list[int] | None = None, rows: list[int] | None = None) -> None:
        """rows: the live rows this forward feeds (increasing; None: every one), e.g. a request joining a
        running batch (Session.admit): its view is a slice of the cache when they are consecutive. counts
        (each row's real tokens of the n) is not needed here: a padded position is written where the row's
        next real token will be, before any query of the row can see it."""
        fed = range(self.rows) if rows is None else rows
        lo, hi = min(self.lengths[b] for b in fed), max(self.lengths[b] for b in fed)
        if hi + n > self.capacity:
            raise TforceError(f"KV cache full: {hi} + {n} tokens > capacity {self.capacity}")
        self.pending, self._S = n, hi + n
        self._fed = None if rows is None else list(rows)
        first = 0 if rows is None else rows[0]
        # the fed rows' storage: rows [first, first + R) as a view, else (rows not consecutive) their indices
        self._block = (first, first + len(fed)) if list(fed) == list(range(first, first + len(fed))) else None
        self._causal = lo == hi  # rows of one length: causal views, no per-row mask
        device = self.k.device
        if self._causal:  # one block at [lo, lo + n) for every row; positions built on the device, no copy
            self._seqlens = None
            pos = torch.arange(lo, lo + n, device=device)
            self._cos, self._sin = self.rotary.cos_sin(pos, self.k.dtype)
            # One new token sees everything before it: no mask needed.
            self._mask = None if n == 1 else visibility(torch.arange(lo + n, device=device)[None], pos)
            slots = pos.expand(len(fed), -1)
        else:
            lengths = to_device(torch.tensor([self.lengths[b] for b in fed]), device)
            slots = lengths[:, None] + torch.arange(n, device=device)  # (B, T)
            self._cos, self._sin = rotation(self.rotary, slots, self.k.dtype)
            # slot s visible to row b's query t iff s <= lengths[b] + t: hides each row's unused tail; the
            # same as seqlens lengths[b] + n, bottom-right causal (CacheView.seqlens)
            self._mask = (torch.arange(self._S, device=device) <= slots[:, :, None])[:, None]  # (B, 1, T, S)
            self._seqlens = (lengths + n).to(torch.int32)
        # _uniform: the one block [lo, lo + n) of consecutive rows that this forward writes, or None (each
        # row's own slots, by index)
        self._uniform = lo if self._causal and self._block is not None else None
        if self._uniform is None:
            self._index = (torch.arange(*self._block, device=device) if self._block is not None
                           else to_device(torch.tensor(list(fed)), device))
            self._rows_idx = self._index[:, None].expand(-1, n)  # (B, T)
            self._slots = slots

    def _write(self, k_store: torch.Tensor, v_store: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """This forward's K/V (B, T, H_kv, D) into one layer's storage (B', S, H_kv, D), at each row's slots."""
        L = self._uniform
        if L is None:
            k_store[self._rows_idx, self._slots] = k
            v_store[self._rows_idx, self._slots] = v
        else:
            a, b = self._block
            k_store[a:b, L:self._S] = k
            v_store[a:b, L:self._S] = v

    def update(self, layer, q, k, v):
        q = self.rotary.rotate(q, self._cos, self._sin)
        k = self.rotary.rotate(k, self._cos, self._sin)
        self._fresh[layer] = q
        S, L, block = self._S, self._uniform, self._block
        if L is None:
            self._write(self.k[layer], self.v[layer], k, v)
        else:  # inline: the one-prompt path's host time
            self.k[layer, block[0]:block[1], L:S] = k
            self.v[layer, block[0]:block[1], L:S] = v
        if block is not None:
            keys, values = self.k[layer, block[0]:block[1], :S], self.v[layer, block[0]:block[1], :S]
        else:  # rows not consecutive (a rare refeed): a copy of theirs
            keys, values = self.k[layer, self._index, :S], self.v[layer, self._index, :S]
        return q, CacheView(keys, values, self._mask, causal=self._causal, seqlens=self._seqlens)

    def commit(self, counts) -> None:
        starts = self.lengths[:self.rows]
        super().commit(counts)
        if self._fresh:
            fresh = list(self._fresh.values())  # in layer order: update() runs layer after layer
            ns = per_row(counts, self.rows)
            fed = list(range(self.rows)) if self._fed is None else self._fed
            for i, b in enumerate(fed):
                n = ns[b]
                if n:
                    # one row: the forward's own tensors; several: copies of the row's (see the docstring)
                    held = fresh if len(fed) == 1 else [q[i:i + 1, :n].clone() for q in fresh]
                    self.row_queries[b] = (starts[b], n, held)
        self._fresh = {}

    def query_at(self, b: int, position: int) -> list[torch.Tensor] | None:
        """Row b's rotated queries (per layer (H_q, D)) at a sequence position, if a kept forward computed
        them; else None (the caller feeds that token again)."""
        held = self.row_queries[b]
        if held is None or not held[0] <= position < held[0] + held[1]:
            return None
        return [q[0, position - held[0]] for q in held[2]]

    def _reset_row(self, b: int) -> None:
        self.row_queries[b] = None

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row dst (empty) takes row src's first n tokens' K/V: a prompt joining a batch whose live row holds
        its prefix (Session.admit)."""
        assert self.lengths[dst] == 0 and n <= self.lengths[src]
        self.k[:, dst, :n] = self.k[:, src, :n]
        self.v[:, dst, :n] = self.v[:, src, :n]
        self.lengths[dst] = n

    def keep(self, rows: list[int]) -> None:
        self.row_queries = [self.row_queries[i] for i in rows] + [None] * (len(self.row_queries) - len(rows))
        super().keep(rows)

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts: list[int] | None = None) -> None:
        """Write one layer's rotated K/V (B, n, H_kv, D) after each row's committed tokens, outside a forward
        (layer-major prefill, a snapshot's load): row b's first counts[b] (None: all n of every row);
        commit_written(counts) then commits them for every layer at once."""
        for b, n in enumerate(counts if counts is not None else [k.shape[1]] * self.rows):
            L = self.lengths[b]
            self.k[layer, b, L:L + n] = k[b, :n]
            self.v[layer, b, L:L + n] = v[b, :n]

    def commit_written(self, counts) -> None:
        """counts: one per row, or an int for every row."""
        new = [a + b for a, b in zip(self.lengths, per_row(counts, self.rows))]
        if max(new) > self.capacity:
            raise TforceError(f"KV cache full: {max(new)} tokens > capacity {self.capacity}")
        self.lengths[:self.rows] = new

    def layer_keys(self, layer: int) -> torch.Tensor:
        """Keys (B, S, H_kv, D) of one layer, committed ones first (for retrieval rebuilds)."""
        return self.k[layer]

    def layer_values(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    # Reads of one row for retrieval rebuilds (cache/retrieval.py, cache/chunkstats.py): rows of tokens,
    # never whole layers.

    def kv_home(self, layer: int) -> torch.device:
        """Where a layer's K/V live (its chunk statistics live there too)."""
        return self.k.device

    def read_keys(self, layer: int, start: int, end: int, row: int = 0) -> torch.Tensor:
        """A row's keys (1, end - start, H_kv, D) of positions [start, end), on the layer's home device."""
        return self.k[layer, row:row + 1, start:end]

    def gather_rows(self, layer: int, idx: torch.Tensor, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """idx (n, H_kv) positions -> a row's K, V (1, n, H_kv, D): for each KV head, the tokens at its
        positions."""
        idx = idx.to(self.k.device)
        return gather_heads(self.k[layer, row:row + 1], idx), gather_heads(self.v[layer, row:row + 1], idx)


def gather_heads(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, S, H_kv, D), idx (n, H_kv) on x's device -> (B, n, H_kv, D)."""
    B, _, H, D = x.shape
    return x.gather(1, idx[None, :, :, None].expand(B, idx.shape[0], H, D))
