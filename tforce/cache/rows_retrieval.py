"""RowsRetrievalCache: RetrievalCache (cache/retrieval.py) for B rows, the middle level of a batch.

Per row b: a fixed budget of slots (layers, B, budget, H_kv, D) with the sequence position of each
(layer, row, KV head, slot) in key_pos (-1 = empty), the row's committed `lengths[b]` and `base[b]` (its
length at its last rebuild), both host (B,) tensors as in cache/batched.py. The row rule of
cache/base.py holds: a forward feeds every row T tokens at its own positions [lengths[b], lengths[b] + T),
padding at a row's end is never committed; row b's position p >= base[b] takes slot
budget - 1 - ((p - base[b]) mod budget) (from the end backwards, wrapping, as RetrievalCache), so a padded
position and the real token that later takes that position share a slot, and a padded slot carries a
position no real query of the row can see before it is overwritten (the visibility rule). New tokens
past budget - chunk_size overwrite the first chunk, then wrap onto the newest ones (batch_session.py rebuilds
before that when the budget leaves room; with a smaller one, e.g. budget == chunk_size, it cannot, and
the middle level then drafts from fewer tokens, as RetrievalCache does): what a slot holds is always
what key_pos says, so attention stays consistent; a padded position may then displace a real entry of
its row, which costs draft quality, never exactness (the full cache verifies). The mask is per row and
KV head: (B, H_kv, T, S) per layer.

rebuild(full, rows, queries) re-selects only the listed rows, each from its own committed keys in
`full` (a RowsCache or RowsOffloadedCache) and its own query, by the chunk rule of retrieval.py
(chunk_positions: first chunk always kept, budget >= length keeps every token, `shared` as there), or
by a `select` rule of cache/policies.py (topk, streaming), asked per row and layer as RetrievalCache
asks it (the row's committed keys, its query): each row selects what a single cache on it alone does.

The chunk rule: each row keeps its own ChunkStats, so a rebuild reads the row's rows committed since
its last rebuild, its partial last chunk and its selected rows: O(budget + new tokens) rows per row and
layer, also from offloaded layers (their rows are gathered in host memory). After a layer-major
prefill the statistics are already taken (observe), so the first rebuild reads only each row's partial
chunk and selection. A select rule reads each row's committed keys of every layer, O(context) per row
and layer (from host memory for an offloaded layer, scored there, as RetrievalCache does). H2O (a pass
over each prompt) is not batched.
"""
from __future__ import annotations

import torch

from ..errors import TforceError
from ..rope import Rotary
from ..sync import to_device
from .base import CacheView
from .batched import _Rows, _rotation
from .chunkstats import ChunkStats, kept_homes
from .retrieval import chunk_positions


class _Row:
    """One row of a batched full cache, seen as ChunkStats and chunk_positions read a FullCache."""

    def __init__(self, full, b: int):
        self.full, self.b = full, b

    def kv_home(self, layer: int) -> torch.device:
        return self.full.kv_home(layer)

    def read_keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.full.read_row_keys(layer, self.b, start, end)

    def gather_rows(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.full.gather_row(layer, self.b, idx)


class RowsRetrievalCache(_Rows):
    def __init__(self, n_layers: int, n_rows: int, n_kv: int, head_dim: int, budget: int, chunk_size: int,
                 rotary: Rotary, dtype=torch.float32, device="cpu", shared: bool = False, select=None,
                 recompute_stats: bool = False):
        shape = (n_layers, n_rows, budget, n_kv, head_dim)  # per layer (B, S=budget, H_kv, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_pos = torch.full((n_layers, n_rows, n_kv, budget), -1, dtype=torch.long, device=device)
        self.budget, self.chunk_size, self.rotary, self.shared = budget, chunk_size, rotary, shared
        self.select = select  # None: the chunk rule; else a policies.py rule
        self.recompute_stats = recompute_stats  # no chunk sums kept for layers on `device` (placement.Plan)
        self._init_rows(n_rows)
        self.base = torch.zeros(n_rows, dtype=torch.long)  # each row's length at its last rebuild
        self.stats: list[ChunkStats | None] = [None] * n_rows  # each row's chunk sums of the full cache

    def new_tokens(self) -> torch.Tensor:
        """(rows,) tokens committed since each row's last rebuild."""
        return self.lengths[:self.rows] - self.base[:self.rows]

    # ---- rebuild ----------------------------------------------------------------------------------

    def _stats(self, full, b: int) -> ChunkStats:
        if self.stats[b] is None:
            homes = [full.kv_home(layer) for layer in range(full.n_layers)]
            n_kv, head_dim = self.k.shape[-2:]
            homes = kept_homes(homes, self.k.device, self.recompute_stats)
            self.stats[b] = ChunkStats(homes, full.capacity, self.chunk_size, n_kv, head_dim,
                                       pin=self.k.device.type == "cuda")
        return self.stats[b]

    def observe(self, full, layer: int, keys: torch.Tensor, counts: list[int]) -> None:
        """Layer-major prefill (prefill_rows_layer_major) hands over a layer's keys (B, n, H_kv, D), row b's
        first counts[b] of them at its positions [lengths[b], ...), while they are on the device: each row's
        chunk sums are taken now, so the prefill's rebuild does not read them back from host memory."""
        for b, n in enumerate(counts):
            if n:
                self._stats(full, b).observe(layer, keys[b:b + 1, :n], int(full.lengths[b]))

    def rebuild(self, full, rows: list[int], queries: list[list[torch.Tensor]]) -> None:
        """Refill the listed rows from their committed tokens in `full`; queries[i]: row rows[i]'s rotated
        query per layer (H_q, D) at its last committed token ([] for an empty row)."""
        for b, query in zip(rows, queries):
            L = int(full.lengths[b])
            self.key_pos[:, b] = -1
            if L:
                row = _Row(full, b)
                for layer, pos in enumerate(self._positions(full, row, query, L)):
                    self._fill(row, layer, b, pos, L)
            self.lengths[b] = self.base[b] = L

    def _positions(self, full, row: _Row, query: list[torch.Tensor], L: int) -> list[torch.Tensor]:
        """Per layer (H_kv, n <= budget) the positions row `row.b` holds after the rebuild."""
        if self.select is None:
            return chunk_positions(self._stats(full, row.b), row, query, L, self.budget, self.shared,
                                   self.key_pos.device)
        positions = []
        for layer, q in enumerate(query):
            keys = row.read_keys(layer, 0, L)[0]  # (L, H_kv, D), the row's committed keys, wherever they live
            positions.append(self.select(layer, keys, L, q.to(keys.device), self.budget))
            assert positions[-1].shape[1] <= self.budget, "a select rule returned more positions than the budget"
        return positions

    def _fill(self, row: _Row, layer: int, b: int, pos: torch.Tensor, L: int) -> None:
        """Row b holds the K/V at pos (H_kv, n <= budget) in slots [0, n); -1 or >= L (the partial last
        chunk's padding): an empty slot."""
        n = pos.shape[1]
        k, v = row.gather_rows(layer, pos.clamp(min=0, max=L - 1).T)
        self.k[layer, b, :n] = k[0].to(self.k.device)
        self.v[layer, b, :n] = v[0].to(self.v.device)
        self.key_pos[layer, b, :, :n] = torch.where(pos < L, pos, -1).to(self.key_pos.device)

    # ---- forwards (the row rule of cache/base.py) -------------------------------------------------

    def begin(self, n: int) -> None:
        B, device = self.rows, self.k.device
        lengths, base = self.lengths[:B], self.base[:B]
        if n > self.budget:
            raise TforceError(f"batched retrieval cache: {n} tokens in one forward > its budget {self.budget}")
        self.pending = n
        pos = lengths[:, None] + torch.arange(n)  # (B, T) per-row positions
        slots = self.budget - 1 - (pos - base[:, None]) % self.budget  # (B, T), from the end backwards, wrapping
        pos, slots = to_device(pos, device), to_device(slots, device)
        self._cos, self._sin = _rotation(self.rotary, pos, self.k.dtype)
        self._rows_idx = torch.arange(B, device=device)[:, None].expand(-1, n)  # (B, T)
        self._slots = slots
        self.key_pos[:, self._rows_idx, :, slots] = pos[:, :, None, None]  # key_pos (layers, B, H_kv, S)
        kp = self.key_pos[:, :B, :, None, :]  # (layers, B, H_kv, 1, S)
        self._mask = (kp >= 0) & (kp <= pos[None, :, None, :, None])  # (layers, B, H_kv, T, S)

    def update(self, layer, q, k, v):
        q = self.rotary.rotate(q, self._cos, self._sin)
        self.k[layer][self._rows_idx, self._slots] = self.rotary.rotate(k, self._cos, self._sin)
        self.v[layer][self._rows_idx, self._slots] = v
        B = self.rows
        return q, CacheView(self.k[layer, :B], self.v[layer, :B], self._mask[layer])

    def truncate(self, lengths: torch.Tensor) -> None:
        """Row b keeps lengths[b] committed tokens (between its last rebuild and what it holds)."""
        assert bool(((lengths >= self.base[:self.rows]) & (lengths <= self.lengths[:self.rows])).all()), \
            "cannot roll back past a rebuild"
        self.lengths[:self.rows] = lengths

    def keep(self, rows: list[int]) -> None:
        """_Rows.keep (rows moved in place, no scratch memory); finished rows' chunk statistics dropped."""
        super().keep(rows)
        self.stats[len(rows):] = [None] * (len(self.stats) - len(rows))

    def _used(self, b: int) -> int:
        return self.budget  # slots wrap: a row may use any of them

    def _move_row(self, i: int, j: int) -> None:
        super()._move_row(i, j)
        self.key_pos[:, j] = self.key_pos[:, i]
        self.base[j] = self.base[i]
        self.stats[j] = self.stats[i]
