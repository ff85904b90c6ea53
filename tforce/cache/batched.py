"""Caches of several sequences at once, one row each, rows of different lengths (the rule is in
cache/base.py: left-aligned rows, per-row `lengths`, padding only at a row's end, a per-row mask).

RowsCache is FullCache for B rows (the verifier's cache and plain decoding's); RowsStreamingCache is
StreamingCache for B rows (the small draft's). Both keep `lengths` on the host as a (B,) long tensor:
the decode loop knows every row's count already (it decides acceptance on the host), so no device ->
host copy is needed to size a view; per-row positions and slots reach the device through
sync.to_device (no sync). Only the first `rows` rows are live; keep(rows) compacts.
"""
from __future__ import annotations

import torch

from ..errors import TforceError
from ..rope import Rotary
from ..sync import to_device
from .base import CacheView
from .full import gather_heads


def _rotation(rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype):
    """positions (B, T) -> cos, sin (B, T, 1, D), broadcasting over (B, T, H, D)."""
    B, T = positions.shape
    cos, sin = rotary.cos_sin(positions.reshape(-1), dtype)  # (B * T, 1, D)
    return cos.view(B, T, 1, -1), sin.view(B, T, 1, -1)


class _Rows:
    """Row bookkeeping shared by the batched caches (here and cache/rows_retrieval.py): lengths, the live
    row count, commit, truncate, keep."""

    def _init_rows(self, n_rows: int) -> None:
        self.rows = n_rows
        self.lengths = torch.zeros(n_rows, dtype=torch.long)
        self.pending = 0

    def commit(self, counts) -> None:
        """Row b keeps the first counts[b] of the pending tokens (counts: (rows,) or an int for all)."""
        counts = torch.as_tensor(counts, dtype=torch.long).expand(self.rows)
        assert bool(((counts >= 0) & (counts <= self.pending)).all())
        self.lengths[:self.rows] += counts
        self.pending = 0

    def truncate(self, lengths: torch.Tensor) -> None:
        """Drop committed tokens from the rows' ends: row b keeps lengths[b] (<= what it holds)."""
        assert bool((lengths <= self.lengths[:self.rows]).all())
        self.lengths[:self.rows] = lengths

    def keep(self, rows: list[int]) -> None:
        """Keep only the listed live rows (increasing), moved to the front in that order (finished rows cost
        nothing after this). Each row that moves is copied in place, row i to row j < i, only the slots it
        uses: no scratch memory (placement.py plans none), and no copy of a row's unused tail."""
        assert all(a < b for a, b in zip(rows, rows[1:])), "keep takes live rows in increasing order"
        for j, i in enumerate(rows):
            if i != j:
                self._move_row(i, j)
        self.lengths[:len(rows)] = self.lengths[torch.tensor(rows, dtype=torch.long)].clone()
        self.rows = len(rows)

    def _used(self, b: int) -> int:
        """Slots row b uses (its committed tokens)."""
        return int(self.lengths[b])

    def _move_row(self, i: int, j: int) -> None:
        """Row i's K/V (every layer) and per-row state go to row j (j < i: row j's are no longer needed)."""
        n = self._used(i)
        self.k[:, j, :n] = self.k[:, i, :n]
        self.v[:, j, :n] = self.v[:, i, :n]


class RowsCache(_Rows):
    """FullCache for B rows. Like FullCache it keeps the rotated queries of the forwards (for retrieval
    rebuilds, cache/rows_retrieval.py): per row, those of the last forward that fed the row real tokens
    (a forward that feeds a row only padding leaves its queries as they were)."""

    def __init__(self, n_layers: int, n_rows: int, n_kv: int, head_dim: int, capacity: int, rotary: Rotary,
                 dtype=torch.float32, device="cpu"):
        shape = (n_layers, n_rows, capacity, n_kv, head_dim)  # per layer (B, S, H_kv, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.rotary, self.n_layers = capacity, rotary, n_layers
        self._init_rows(n_rows)
        self._fresh: dict[int, torch.Tensor] = {}  # layer -> this forward's rotated queries (B, T, H_q, D)
        # per row: (first position, per layer (T_b, H_q, D) its real queries) or None
        self.row_queries: list[tuple[int, list[torch.Tensor]] | None] = [None] * n_rows

    def commit(self, counts) -> None:
        counts = torch.as_tensor(counts, dtype=torch.long).expand(self.rows)
        starts = self.lengths[:self.rows].tolist()
        super().commit(counts)
        for b, n in enumerate(counts.tolist()):
            if n and self._fresh:
                # copies: a view would keep the whole batch's forward alive for this row alone
                self.row_queries[b] = (starts[b], [self._fresh[i][b, :n].clone() for i in sorted(self._fresh)])
        self._fresh = {}

    def query_at(self, b: int, position: int) -> list[torch.Tensor] | None:
        """Row b's rotated queries (per layer (H_q, D)) at a sequence position, if a kept forward computed
        them; else None (the caller feeds that token again)."""
        held = self.row_queries[b]
        if held is None or not held[0] <= position < held[0] + len(held[1][0]):
            return None
        return [q[position - held[0]] for q in held[1]]

    def keep(self, rows: list[int]) -> None:
        self.row_queries = [self.row_queries[i] for i in rows] + [None] * (len(self.row_queries) - len(rows))
        super().keep(rows)

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts: list[int]) -> None:
        """Write one layer's rotated K/V (B, n, H_kv, D) after each row's committed tokens, outside a forward
        (layer-major prefill, prefill.py): row b's first counts[b]; commit_written(counts) then commits
        them for every layer at once."""
        for b, n in enumerate(counts):
            L = int(self.lengths[b])
            self.k[layer, b, L:L + n] = k[b, :n]
            self.v[layer, b, L:L + n] = v[b, :n]

    def commit_written(self, counts: list[int]) -> None:
        counts = torch.tensor(counts, dtype=torch.long)
        if int((self.lengths[:self.rows] + counts).max()) > self.capacity:
            raise TforceError(f"KV cache full: {int((self.lengths[:self.rows] + counts).max())} tokens > "
                              f"capacity {self.capacity}")
        self.lengths[:self.rows] += counts

    # Reads of one row for retrieval rebuilds (cache/rows_retrieval.py): rows of tokens, never whole layers.

    def kv_home(self, layer: int) -> torch.device:
        return self.k.device

    def read_row_keys(self, layer: int, b: int, start: int, end: int) -> torch.Tensor:
        """Row b's keys (1, end - start, H_kv, D) of positions [start, end), on the layer's home device."""
        return self.k[layer, b:b + 1, start:end]

    def gather_row(self, layer: int, b: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx (n, H_kv) positions -> row b's K, V (1, n, H_kv, D), each KV head's rows at its positions."""
        idx = idx.to(self.k.device)
        return gather_heads(self.k[layer, b:b + 1], idx), gather_heads(self.v[layer, b:b + 1], idx)

    def begin(self, n: int) -> None:
        lengths = self.lengths[:self.rows]
        if int(lengths.max()) + n > self.capacity:
            raise TforceError(f"KV cache full: {int(lengths.max())} + {n} tokens > capacity {self.capacity}")
        self.pending = n
        device = self.k.device
        pos = to_device(lengths, device)[:, None] + torch.arange(n, device=device)  # (B, T) per-row positions
        self._cos, self._sin = _rotation(self.rotary, pos, self.k.dtype)
        self._rows_idx = torch.arange(self.rows, device=device)[:, None].expand(-1, n)  # (B, T)
        self._slots = pos
        self._S = int(lengths.max()) + n
        # Rows of one length (a batch of one, prompts of one length decoding in step) write one block;
        # one new token each then sees every slot of the view: no mask, as FullCache's one-token forward.
        self._uniform = int(lengths.min()) if int(lengths.min()) == self._S - n else None
        # slot s visible to row b's query t iff s <= lengths[b] + t: hides each row's unused tail
        self._mask = None if self._uniform is not None and n == 1 else \
            (torch.arange(self._S, device=device) <= pos[:, :, None])[:, None]  # (B, 1, T, S)

    def update(self, layer, q, k, v):
        q = self.rotary.rotate(q, self._cos, self._sin)
        k = self.rotary.rotate(k, self._cos, self._sin)
        self._fresh[layer] = q
        B, S, L = self.rows, self._S, self._uniform
        if L is None:
            self.k[layer][self._rows_idx, self._slots] = k
            self.v[layer][self._rows_idx, self._slots] = v
        else:
            self.k[layer, :B, L:S] = k
            self.v[layer, :B, L:S] = v
        return q, CacheView(self.k[layer, :B, :S], self.v[layer, :B, :S], self._mask)


class RowsStreamingCache(_Rows):
    """StreamingCache's view per row (sinks, the last `window` committed tokens, the new ones; keys
    stored un-rotated, rotated by their slot in the view), over rows of different lengths. Row b's
    position s >= sinks sits in slot sinks + s - offset[b]; a row is compacted on its own when its new
    tokens would pass the capacity. Views of rows shorter than the longest are padded at the end with
    masked slots."""

    def __init__(self, n_layers: int, n_rows: int, n_kv: int, head_dim: int, budget: int, sinks: int,
                 rotary: Rotary, max_rollback: int, max_new: int, dtype=torch.float32, device="cpu"):
        assert 0 <= sinks < budget
        self.sinks, self.window = sinks, budget - sinks
        self.keep_rows = self.window + max_rollback  # tokens kept beyond the sinks at compaction
        self.capacity = sinks + self.keep_rows + max_new
        shape = (n_layers, n_rows, self.capacity, n_kv, head_dim)  # per layer (B, S, H_kv, D), un-rotated
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.rotary, self.max_new = rotary, max_new
        self.offset = torch.full((n_rows,), sinks, dtype=torch.long)  # position held in slot `sinks`
        self._init_rows(n_rows)

    def _used(self, b: int) -> int:
        return self._slot(b, int(self.lengths[b]))

    def _move_row(self, i: int, j: int) -> None:
        super()._move_row(i, j)
        self.offset[j] = self.offset[i]

    def _slot(self, b: int, pos: int) -> int:
        return pos if pos < self.sinks else self.sinks + pos - int(self.offset[b])

    def _compact(self, b: int) -> None:
        length = int(self.lengths[b])
        start = max(self.sinks, length - self.keep_rows)
        if start <= int(self.offset[b]):
            return
        a, e = self._slot(b, start), self._slot(b, length)
        self.k[:, b, self.sinks:self.sinks + e - a] = self.k[:, b, a:e].clone()
        self.v[:, b, self.sinks:self.sinks + e - a] = self.v[:, b, a:e].clone()
        self.offset[b] = start

    def begin(self, n: int) -> None:
        if n > self.max_new:
            raise TforceError(f"streaming cache takes at most {self.max_new} tokens per forward, got {n}")
        self.pending = n
        views, news = [], []
        for b in range(self.rows):
            length = int(self.lengths[b])
            if self._slot(b, length + n) > self.capacity:
                self._compact(b)
            n_sinks = min(self.sinks, length)
            lo = max(n_sinks, length - self.window)
            first = self._slot(b, lo)
            views.append(list(range(n_sinks)) + list(range(first, first + length + n - lo)))
            news.append(list(range(self._slot(b, length), self._slot(b, length) + n)))
        S = max(len(r) for r in views)
        sizes = torch.tensor([len(r) for r in views])
        device = self.k.device
        self._view_slots = to_device(torch.tensor([r + [0] * (S - len(r)) for r in views]), device)  # (B, S)
        self._new_slots = to_device(torch.tensor(news), device)  # (B, T)
        self._rows_view = torch.arange(self.rows, device=device)[:, None]
        self._cos, self._sin = self.rotary.cos_sin(torch.arange(S, device=device), self.k.dtype)  # by view slot
        qpos = (sizes - n)[:, None] + torch.arange(n)  # (B, T): each new token's slot in its row's view
        qpos = to_device(qpos, device)
        self._qcos, self._qsin = _rotation(self.rotary, qpos, self.k.dtype)
        self._mask = (torch.arange(S, device=device) <= qpos[:, :, None])[:, None]  # (B, 1, T, S)

    def update(self, layer, q, k, v):
        self.k[layer][self._rows_view, self._new_slots] = k
        self.v[layer][self._rows_view, self._new_slots] = v
        keys = self.rotary.rotate(self.k[layer][self._rows_view, self._view_slots], self._cos, self._sin)
        q = self.rotary.rotate(q, self._qcos, self._qsin)
        return q, CacheView(keys, self.v[layer][self._rows_view, self._view_slots], self._mask)

    def truncate(self, lengths: torch.Tensor) -> None:
        for b in range(self.rows):
            keep = int(lengths[b])
            if self.sinks <= max(min(self.sinks, keep), keep - self.window) < int(self.offset[b]):
                raise TforceError("streaming cache rolled back further than it keeps (max_rollback too small)")
        super().truncate(lengths)
