"""StreamingCache: StreamingLLM's attention sinks + recent window, in fixed buffers, one row per sequence.

The view a forward of T new tokens attends to is: the first `sinks` tokens of the sequence, the last
`window = budget - sinks` committed tokens before the new ones, and the T new tokens (causally).
Keys are stored un-rotated and rotated by their slot in that view at each forward (StreamingLLM's
position rule, docs/architecture.md): RoPE positions never exceed budget + T, whatever the sequence length.

Storage, per row: slots [0, sinks) hold the sinks; slots [sinks, capacity) hold a run of consecutive
positions starting at the row's `offset` (position s >= sinks sits in slot sinks + s - offset[b]).
Speculative tokens can be rolled back up to `max_rollback` tokens below the longest committed length,
so compaction keeps that many tokens beyond the window; a row is compacted when its new tokens would
pass the capacity.

Rows that share a length and an offset (always one row) take the fast path: one set of slots for every
row, a contiguous causal view (CUDA graphs and flash-attn apply). Rows of different lengths gather each
row's view from its own slots, padded at the end to the longest with masked slots (docs/architecture.md).
"""
from __future__ import annotations

import torch

from ..errors import TforceError
from .rope import Rotary
from ..transfer import to_device
from .base import CacheView, StaticInputs, visibility
from .rows import Rows, per_row, rotation


class StreamingCache(StaticInputs, Rows):
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, budget: int, sinks: int, rotary: Rotary,
                 max_rollback: int, max_new: int, dtype=torch.float32, device="cpu", rows: int = 1):
        assert 0 <= sinks < budget
        self.sinks, self.window = sinks, budget - sinks
        self.kept = self.window + max_rollback  # tokens kept beyond the sinks at compaction
        self.capacity = sinks + self.kept + max_new
        shape = (n_layers, rows, self.capacity, n_kv, head_dim)  # per layer (B, S, H_kv, D), un-rotated keys
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.rotary, self.max_new = rotary, max_new
        self.offset = [sinks] * rows  # position held in slot `sinks`, per row
        self._init_rows(rows)
        self._same = True

    def _slot(self, b: int, pos: int) -> int:
        return pos if pos < self.sinks else self.sinks + pos - self.offset[b]

    def _view_start(self, length: int) -> tuple[int, int]:
        """(sinks held, first sequence position of the recent window) of a row's next view."""
        n_sinks = min(self.sinks, length)
        return n_sinks, max(n_sinks, length - self.window)

    def _compact(self, rows: range, length: int, offset: int) -> int:
        """Move the rows' kept run to slot `sinks`; returns their new offset."""
        start = max(self.sinks, length - self.kept)
        if start <= offset:
            return offset
        a, e = self.sinks + start - offset, self.sinks + length - offset
        r = slice(rows.start, rows.stop)
        self.k[:, r, self.sinks:self.sinks + e - a] = self.k[:, r, a:e].clone()
        self.v[:, r, self.sinks:self.sinks + e - a] = self.v[:, r, a:e].clone()
        for b in rows:
            self.offset[b] = start
        return start

    subsets = True  # a forward may feed some of the rows (begin's rows): the others sit it out, untouched

    def begin(self, n: int, counts: list[int] | None = None, rows: list[int] | None = None) -> None:
        """rows: the live rows this forward feeds (increasing; None: every one). counts (each fed row's real
        tokens of the n) is not needed here: padding lands in the slots after the row's window, the room
        max_new keeps for a forward's new tokens."""
        if n > self.max_new:
            raise TforceError(f"streaming cache takes at most {self.max_new} tokens per forward, got {n}")
        self.pending = n
        shared = self.common(self.offset) if rows is None else None  # (length, offset) of every row, or None
        self._same = shared is not None
        if self._same:
            self._begin_shared(n, *shared)
        else:
            self._begin_rows(n, range(self.rows) if rows is None else rows)

    def _begin_shared(self, n: int, length: int, offset: int) -> None:
        """One view for every row; everything built on the device from Python ints: no host -> device copy."""
        if self.sinks + length + n - offset > self.capacity and length + n > self.sinks:
            offset = self._compact(range(self.rows), length, offset)
        n_sinks, lo = self._view_start(length)
        device = self.k.device
        pos = torch.cat([torch.arange(n_sinks, device=device), torch.arange(lo, length + n, device=device)])  # (S,)
        first = lo if lo < self.sinks else self.sinks + lo - offset
        slots = torch.cat([torch.arange(n_sinks, device=device),
                           torch.arange(first, first + length + n - lo, device=device)])
        self._view = self._static("view", slots)
        first = length if length < self.sinks else self.sinks + length - offset
        self._new = self._static("new", torch.arange(first, first + n, device=device))
        cos, sin = self.rotary.cos_sin(torch.arange(len(pos), device=device), self.k.dtype)
        self._cos, self._sin = self._static("cos", cos), self._static("sin", sin)
        self._qcos, self._qsin = self._cos[-n:], self._sin[-n:]
        self._mask = None if n == 1 else self._static("mask", visibility(pos[None], pos[-n:]))
        self.view_positions = pos

    def _begin_rows(self, n: int, rows) -> None:
        """Each fed row's own view, padded at the end to the longest with masked slots: row b's view is its
        sinks' slots [0, n_sinks) then the run [first, first + size - n_sinks) of its window and new tokens.
        Built from one small tensor of per-row ints (a list per slot cost 0.4 ms a forward for 8 rows)."""
        per_row = []  # (b, n_sinks, first slot of the run, view size, first new slot)
        for b in rows:
            length = self.lengths[b]
            if self._slot(b, length + n) > self.capacity:
                self._compact(range(b, b + 1), length, self.offset[b])
            n_sinks, lo = self._view_start(length)
            per_row.append((b, n_sinks, self._slot(b, lo), n_sinks + length + n - lo, self._slot(b, length)))
        device = self.k.device
        b, n_sinks, first, sizes, new = to_device(torch.tensor(per_row), device).T[:, :, None]  # each (R, 1)
        S = max(r[3] for r in per_row)
        j = torch.arange(S, device=device)
        slots = torch.where(j < n_sinks, j, first + j - n_sinks)
        slots = torch.where(j < sizes, slots, 0)  # (R, S); padding reads slot 0, masked
        # each view slot's index among a layer's rows x capacity slots: one index_select per layer reads the
        # views (6x faster than indexing by (row, slot) pairs for 8 rows of a 256-token window on the CPU)
        self._view_flat = (b * self.capacity + slots).reshape(-1)
        self._new_flat = (b * self.capacity + new + torch.arange(n, device=device)).reshape(-1)  # (R * T,): writes
        self._cos, self._sin = self.rotary.cos_sin(j, self.k.dtype)  # by view slot
        qpos = sizes - n + torch.arange(n, device=device)  # (R, T): each new token's view slot
        self._qcos, self._qsin = rotation(self.rotary, qpos, self.k.dtype)
        self._mask = (j <= qpos[:, :, None])[:, None]  # (R, 1, T, S)
        self._seqlens = sizes[:, 0].to(torch.int32)  # the same rule (CacheView.seqlens)

    def graph_key(self):
        """The view's size and the row count, once the window is full (before that it grows every step) and
        while the rows share one view."""
        full = self._same and self.length >= self.sinks + self.window
        return ("streaming", self.sinks + self.window + self.pending, self.rows) if full else None

    def update(self, layer, q, k, v):
        if self._same:
            B = self.rows
            self.k[layer, :B, self._new] = k
            self.v[layer, :B, self._new] = v
            keys = self.rotary.rotate(self.k[layer, :B, self._view], self._cos, self._sin)
            q = self.rotary.rotate(q, self._qcos, self._qsin)
            return q, CacheView(keys, self.v[layer, :B, self._view], self._mask, causal=True)
        # (rows * capacity, H_kv, D) views of the layer (view, not flatten: a copy would drop the writes)
        k_all, v_all = (x[layer].view(-1, *x.shape[3:]) for x in (self.k, self.v))
        k_all.index_copy_(0, self._new_flat, k.flatten(0, 1))
        v_all.index_copy_(0, self._new_flat, v.flatten(0, 1))
        shape = (len(q), -1, *k.shape[2:])  # (R, S, H_kv, D)
        keys = k_all.index_select(0, self._view_flat).view(shape)
        values = v_all.index_select(0, self._view_flat).view(shape)
        keys = self.rotary.rotate(keys, self._cos, self._sin)
        q = self.rotary.rotate(q, self._qcos, self._qsin)
        return q, CacheView(keys, values, self._mask, seqlens=self._seqlens)

    def _reach(self, b: int, length: int) -> bool:
        """Whether row b can roll back to `length` (its window's start is still held)."""
        return self._reaches(self.offset[b], length)

    def _reaches(self, offset: int, length: int) -> bool:
        return not self.sinks <= max(min(self.sinks, length), length - self.window) < offset

    def truncate(self, lengths) -> None:
        keep = per_row(lengths, self.rows)
        if not all(self._reach(b, n) for b, n in enumerate(keep)):
            raise TforceError("streaming cache rolled back further than it keeps (max_rollback too small)")
        super().truncate(lengths)
        for b, n in enumerate(keep):
            if n <= self.sinks:  # nothing of the window is left: it starts again in the slot after the sinks
                self.offset[b] = self.sinks

    def _used(self, b: int) -> int:
        return self._slot(b, self.lengths[b])

    def _move_row(self, i: int, j: int) -> None:
        super()._move_row(i, j)
        self.offset[j] = self.offset[i]

    def _reset_row(self, b: int) -> None:
        self.offset[b] = self.sinks

    # Saved states of one row: the cache rolls back only max_rollback tokens, so a conversation that returns
    # to a document's end (or a KV snapshot) restores the state taken there instead.

    def reachable(self, length: int) -> bool:
        """Whether truncate(length) can roll back to that length."""
        return length <= self.length and self._reach(0, length)

    def reachable_from(self, state: dict, length: int) -> bool:
        """Whether a row restored to `state` (state(), a snapshot's) could roll back to `length`."""
        return length <= state["length"] and self._reaches(int(state["offset"]), length)

    def state(self) -> dict:
        """A copy in host memory of what row 0 holds: its slots (layers, 1, used, H_kv, D), length and offset."""
        used = self._used(0)
        return {"k": self.k[:, :1, :used].to("cpu", copy=True), "v": self.v[:, :1, :used].to("cpu", copy=True),
                "length": self.length, "offset": self.offset[0]}

    def fits(self, state: dict) -> bool:
        """Whether a state (of this cache's geometry, e.g. from a snapshot) can be restored here."""
        k = state["k"]
        return (k.shape[0] == self.k.shape[0] and k.shape[1] == 1 and k.shape[3:] == self.k.shape[3:]
                and k.dtype == self.k.dtype and k.shape[2] <= self.capacity and int(state["offset"]) >= self.sinks)

    def restore(self, state: dict | None, rows: list[int] = (0,)) -> None:
        """Each listed row holds exactly what state() copied (None: every row holds nothing, as when built)."""
        self.pending = 0
        if state is None:
            self.lengths[:] = [0] * len(self.lengths)
            self.offset[:] = [self.sinks] * len(self.offset)
            return
        used = state["k"].shape[2]
        for b in rows:
            self.k[:, b, :used] = state["k"][:, 0].to(self.k.device)
            self.v[:, b, :used] = state["v"][:, 0].to(self.v.device)
            self.lengths[b], self.offset[b] = int(state["length"]), int(state["offset"])
