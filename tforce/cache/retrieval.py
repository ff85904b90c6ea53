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
true position (docs/architecture.md), so any subset is attended exactly as in the full cache: with a budget
>= the context, this cache gives the full cache's attention.

Rows. Each row has its own budget of slots, its own key positions (key_pos (layers, B, H_kv, budget + 1),
-1 = empty), its committed `lengths[b]` and `base[b]` (its length at its last rebuild), and its own chunk
statistics; rebuild(full, rows, queries) re-selects only the listed rows, each from its own committed keys
in `full` (a FullCache or OffloadedCache of as many rows) and its own query, exactly what a one-row cache
on that row alone selects. Row b's position p >= base[b] takes slot budget - 1 - ((p - base[b]) mod
budget) (from the end backwards, wrapping). A forward's padding (rows feeding fewer tokens than others:
the row rule of docs/architecture.md; begin(n, counts)) goes to one spill slot after the budget, never
visible, so it overwrites nothing a row holds, and the rebuild rule has no term for padding; a row that
sits a forward out (begin's rows: engine/levels.py) is not touched at all. New
tokens past budget - chunk_size overwrite the first chunk, then wrap onto the newest ones (the engine
rebuilds before that when the budget leaves room; with a smaller one it cannot, and the middle level then
drafts from fewer tokens): what a slot holds is always what key_pos says, so attention stays consistent
and exactness never depends on it (the full cache verifies). Rows that share a length and a base (always
one row) write one set of slots and their forwards may be replayed from CUDA graphs; the mask is per row
and KV head either way, (B, H_kv, T, S) per layer.

With `shared=True` ("shared" policy) one selection serves every layer and KV head: each (layer, head)'s
chunk scores, scaled by 1/sqrt(head_dim), become a softmax over chunks; their mean over layers and
heads ranks the chunks once. Why: in a small model the heads that copy a passkey sit in the lowest
layers, and the last prompt token's query there does not point at the key (the next tokens' queries
do); per-layer selection drops the key from exactly those layers, while a model-wide vote keeps the
chunks the answering layers point at everywhere (EVALUATION.md). It scores from the same statistics.

Other selection rules (Top-K, StreamingLLM, H2O: cache/policies.py) fill the same fixed budget through
`select(layer, keys, length, query, budget, row) -> positions (H_kv, n <= budget)` (-1 = empty, descending
importance), asked per row with that row's keys and query; `select=None` is the chunk rule above. Those rules
read a layer's full keys. A rule that keeps per-row state (H2O's prompt scores) is told by `keep` which rows
stay, so its state follows the rows as finished ones are compacted away.
"""
from __future__ import annotations

import math

import torch

from ..errors import TforceError
from .rope import Rotary
from ..transfer import to_device
from .base import CacheView, StaticInputs
from .chunkstats import ChunkStats
from .rows import Rows, per_row, rotation


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


class _Row:
    """One row of a full cache, seen as ChunkStats and chunk_positions read a cache of one row."""

    def __init__(self, full, b: int):
        self.full, self.b = full, b

    def kv_home(self, layer: int) -> torch.device:
        return self.full.kv_home(layer)

    def read_keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.full.read_keys(layer, start, end, self.b)

    def gather_rows(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.full.gather_rows(layer, idx, self.b)


class RetrievalCache(StaticInputs, Rows):
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, budget: int, chunk_size: int,
                 rotary: Rotary, dtype=torch.float32, device="cpu", select=None, shared: bool = False,
                 recompute_stats: bool = False, rows: int = 1):
        self.select = select  # None: the chunk rule; else a policies.py rule
        self.recompute_stats = recompute_stats  # no chunk sums kept for layers on `device` (placement.Plan)
        self.shared = shared  # the chunk rule with one selection for all layers and heads
        # per layer (B, S, H_kv, D): `budget` slots, then one spill slot that a ragged forward's padding is
        # written to (begin), so that padding never overwrites a slot a row holds. The spill slot's key
        # position stays -1 (never visible).
        shape = (n_layers, rows, budget + 1, n_kv, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_pos = torch.full((n_layers, rows, n_kv, budget + 1), -1, dtype=torch.long, device=device)
        self.budget, self.chunk_size, self.rotary = budget, chunk_size, rotary
        self._init_rows(rows)
        self.base = [0] * rows  # each row's length at its last rebuild
        # each row's chunk statistics (the chunk rule's) and the full cache they describe
        self.stats: list[ChunkStats | None] = [None] * rows
        self._stats_of: list = [None] * rows
        self._same = True

    def new_tokens(self) -> list[int]:
        """Per live row, tokens committed since its last rebuild."""
        return [n - b for n, b in zip(self.lengths[:self.rows], self.base)]

    # ---- rebuild ----------------------------------------------------------------------------------

    def stats_for(self, full, b: int = 0) -> ChunkStats:
        """Row b's chunk statistics of `full` (allocated at first use, next to each layer's KV)."""
        if self._stats_of[b] is not full:
            self.stats[b] = ChunkStats.for_cache(full, self.chunk_size, self.recompute_stats)
            self._stats_of[b] = full
        return self.stats[b]

    def forget_rows(self, length: int, b: int = 0) -> None:
        """Row b of the full cache was rolled back to `length` and will be written again from there (a
        conversation's next prompt): its chunk statistics above `length` no longer hold."""
        if self.stats[b] is not None:
            self.stats[b].truncate(length)

    def observe(self, full, layer: int, keys: torch.Tensor, counts: list[int] | None = None) -> None:
        """Layer-major prefill hands over a layer's keys (B, n, H_kv, D), row b's first counts[b] (None: all)
        of them at its positions [full.lengths[b], ...), while they are on the device: each row's chunk
        sums are taken now, not read back later."""
        for b, n in enumerate(counts if counts is not None else [keys.shape[1]] * self.rows):
            if n:
                self.stats_for(full, b).observe(layer, keys[b:b + 1, :n], full.lengths[b])

    def rebuild(self, full, rows: list[int], queries: list[list[torch.Tensor]]) -> None:
        """Refill the listed rows from their committed tokens in `full`; queries[i]: row rows[i]'s rotated
        query per layer (H_q, D) at its last committed token ([] for an empty row)."""
        for b, query in zip(rows, queries):
            L = full.lengths[b]
            self.key_pos[:, b] = -1
            if L:
                row = _Row(full, b)
                for layer, pos in enumerate(self._positions(full, row, query, L)):
                    self._fill(row, layer, b, pos, L)
            self.lengths[b] = self.base[b] = L

    def _positions(self, full, row: _Row, query: list[torch.Tensor], L: int) -> list[torch.Tensor]:
        """Per layer (H_kv, n <= budget) the positions row `row.b` holds after the rebuild."""
        if self.select is None:
            return chunk_positions(self.stats_for(full, row.b), row, query, L, self.budget, self.shared,
                                   self.key_pos.device)
        positions = []
        for layer, q in enumerate(query):
            keys = row.read_keys(layer, 0, L)[0]  # (L, H_kv, D), the row's committed keys, wherever they live
            positions.append(self.select(layer, keys, L, q.to(keys.device), self.budget, row.b))
            assert positions[-1].shape[1] <= self.budget, "a select rule returned more positions than the budget"
        return positions

    def _fill(self, row: _Row, layer: int, b: int, pos: torch.Tensor, L: int) -> None:
        """Row b holds the K/V at pos (H_kv, n <= budget) in slots [0, n); -1 or >= L (the partial last
        chunk's padding): an empty slot."""
        n = pos.shape[1]
        k, v = row.gather_rows(layer, pos.clamp(min=0, max=L - 1).T)  # only these, wherever the layer lives
        self.k[layer, b, :n] = k[0].to(self.k.device)
        self.v[layer, b, :n] = v[0].to(self.v.device)
        self.key_pos[layer, b, :, :n] = torch.where(pos < L, pos, -1).to(self.key_pos.device)

    # ---- forwards (the row rule of docs/architecture.md) -------------------------------------------------

    def graph_key(self):
        """Fixed shapes while the rows share their slots: every forward of T tokens looks the same."""
        return ("retrieval", self.rows) if self._same else None

    subsets = True  # a forward may feed some of the rows (begin's rows): the others sit it out, untouched

    def begin(self, n: int, counts: list[int] | None = None, rows: list[int] | None = None) -> None:
        """n tokens per fed row (rows: the live rows this forward feeds, increasing; None: every one), of which
        row rows[i]'s first counts[i] are real (None: all n); the rest is padding, written to the spill slot."""
        if n > self.budget:
            raise TforceError(f"retrieval cache: {n} tokens in one forward > its budget {self.budget}")
        self.pending = n
        shared = self.common(self.base) if rows is None else None  # (length, base) of every row, or None
        self._same = shared is not None and (counts is None or min(counts) == n)
        B, device = self.rows, self.key_pos.device
        self._fed = None  # the fed rows' indices when they are not all the live rows
        if self._same:  # one set of slots; built on the device from Python ints, kept in static buffers
            L, base = shared
            pos = torch.arange(L, L + n, device=device)
            offset = torch.arange(L - base, L - base + n, device=device)
            self._slot = self._static("slot", self.budget - 1 - offset % self.budget)  # from the end backwards
            cos, sin = self.rotary.cos_sin(pos, self.k.dtype)
            self._cos, self._sin = self._static("cos", cos), self._static("sin", sin)
            self.key_pos[:, :B, :, self._slot] = pos
            qpos = pos[:, None]  # (T, 1)
            kp = self.key_pos[:, :B, :, None, :]  # (layers, B, H_kv, 1, S)
        else:
            fed = list(range(B)) if rows is None else list(rows)
            lengths, bases = torch.tensor([self.lengths[b] for b in fed]), torch.tensor([self.base[b] for b in fed])
            pos = lengths[:, None] + torch.arange(n)  # (R, T) per-row positions
            slots = self.budget - 1 - (pos - bases[:, None]) % self.budget  # (R, T), wrapping
            held = pos  # the key position each slot takes: padding's is -1 in the spill slot, never visible
            if counts is not None:
                pad = torch.arange(n) >= torch.tensor(counts)[:, None]
                slots, held = torch.where(pad, self.budget, slots), torch.where(pad, -1, pos)
            pos, slots, held = to_device(pos, device), to_device(slots, device), to_device(held, device)
            self._cos, self._sin = rotation(self.rotary, pos, self.k.dtype)
            idx = to_device(torch.tensor(fed), device)
            self._rows_idx = idx[:, None].expand(-1, n)  # (R, T)
            self._slots = slots
            self.key_pos[:, self._rows_idx, :, slots] = held[:, :, None, None]
            qpos = pos[None, :, None, :, None]  # (1, R, 1, T, 1)
            if rows is not None:
                self._fed = idx
            kp = self.key_pos[:, :B, :, None, :] if rows is None else self.key_pos[:, idx, :, None, :]
        mask = (kp >= 0) & (kp <= qpos)  # (layers, R, H_kv, T, S): the visibility rule, per row
        self._mask = self._static("mask", mask) if self._same else mask

    def update(self, layer, q, k, v):
        q = self.rotary.rotate(q, self._cos, self._sin)
        k = self.rotary.rotate(k, self._cos, self._sin)
        B = self.rows
        if self._same:
            self.k[layer, :B, self._slot] = k
            self.v[layer, :B, self._slot] = v
        else:
            self.k[layer][self._rows_idx, self._slots] = k
            self.v[layer][self._rows_idx, self._slots] = v
        if self._fed is not None:  # some rows: their slots gathered (a copy of theirs only; index_select copies
            # 7 rows of 257 slots in half the time of indexing by a tensor on the CPU)
            return q, CacheView(self.k[layer].index_select(0, self._fed), self.v[layer].index_select(0, self._fed),
                                self._mask[layer])
        return q, CacheView(self.k[layer, :B], self.v[layer, :B], self._mask[layer])

    def truncate(self, lengths) -> None:
        """Row b keeps lengths[b] committed tokens (between its last rebuild and what it holds)."""
        assert all(k >= b for k, b in zip(per_row(lengths, self.rows), self.base)), "cannot roll back past a rebuild"
        super().truncate(lengths)

    def keep(self, rows: list[int]) -> None:
        """Rows.keep (rows moved in place, no scratch memory); finished rows' chunk statistics dropped; a
        select rule's per-row state (H2O's scores) moves with its rows, so row b still selects by its own."""
        super().keep(rows)
        gone = len(self.stats) - len(rows)
        self.stats[len(rows):], self._stats_of[len(rows):] = [None] * gone, [None] * gone
        keep = getattr(self.select, "keep", None)
        if keep is not None:
            keep(rows)

    def _reset_row(self, b: int) -> None:
        self.key_pos[:, b] = -1
        self.base[b] = 0
        self.stats[b], self._stats_of[b] = None, None

    def _used(self, b: int) -> int:
        return self.budget  # slots wrap: a row may use any of them (not the spill slot: padding)

    def _move_row(self, i: int, j: int) -> None:
        super()._move_row(i, j)
        self.key_pos[:, j] = self.key_pos[:, i]
        self.base[j] = self.base[i]
        self.stats[j], self._stats_of[j] = self.stats[i], self._stats_of[i]
