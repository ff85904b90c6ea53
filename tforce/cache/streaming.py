"""StreamingCache: StreamingLLM's attention sinks + recent window, in fixed buffers.

The view a forward of T new tokens attends to is: the first `sinks` tokens of the sequence, the last
`window = budget - sinks` committed tokens before the new ones, and the T new tokens (causally).
Keys are stored un-rotated and rotated by their slot in that view at each forward (StreamingLLM's
position rule, cache/base.py): RoPE positions never exceed budget + T, whatever the sequence length.

Storage: rows [0, sinks) hold the sinks; rows [sinks, capacity) hold a run of consecutive positions
starting at `offset`. Speculative tokens can be rolled back up to `max_rollback` tokens below the
longest committed length, so compaction keeps that many tokens beyond the window.
"""
from __future__ import annotations

import torch

from ..errors import TforceError
from ..rope import Rotary
from .base import CacheView, StaticInputs, visibility


class StreamingCache(StaticInputs):
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, budget: int, sinks: int, rotary: Rotary,
                 max_rollback: int, max_new: int, dtype=torch.float32, device="cpu"):
        assert 0 <= sinks < budget
        self.sinks, self.window = sinks, budget - sinks
        self.keep = self.window + max_rollback  # tokens kept beyond the sinks at compaction
        self.capacity = sinks + self.keep + max_new
        shape = (n_layers, 1, self.capacity, n_kv, head_dim)  # per layer (B, S, H_kv, D), un-rotated keys
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.rotary = rotary
        self.max_new = max_new
        self.length = 0
        self.offset = sinks  # sequence position held in row `sinks`
        self.pending = 0

    def _row(self, pos: int) -> int:
        return pos if pos < self.sinks else self.sinks + pos - self.offset

    def _view_start(self) -> tuple[int, int]:
        """(sinks held, first sequence position of the recent window) of the next view."""
        n_sinks = min(self.sinks, self.length)
        return n_sinks, max(n_sinks, self.length - self.window)

    def positions(self, n: int) -> torch.Tensor:
        """Sequence positions (S,) of the view for n new tokens: sinks, the recent window, the new
        tokens; built on the cache's device from Python ints."""
        n_sinks, lo = self._view_start()
        device = self.k.device
        return torch.cat([torch.arange(n_sinks, device=device), torch.arange(lo, self.length + n, device=device)])

    def _compact(self) -> None:
        start = max(self.sinks, self.length - self.keep)
        if start <= self.offset:
            return
        a, b = self._row(start), self._row(self.length)
        self.k[:, :, self.sinks:self.sinks + b - a] = self.k[:, :, a:b].clone()
        self.v[:, :, self.sinks:self.sinks + b - a] = self.v[:, :, a:b].clone()
        self.offset = start

    def begin(self, n: int) -> None:
        if n > self.max_new:
            raise TforceError(f"streaming cache takes at most {self.max_new} tokens per forward, got {n}")
        if self._row(self.length + n) > self.capacity:
            self._compact()
        self.pending = n
        # Everything below is built on the device from Python ints: no host -> device copy.
        pos = self.positions(n)  # (S,) sequence positions, in view order
        n_sinks, lo = self._view_start()
        first, device = self._row(lo), self.k.device
        rows = torch.cat([torch.arange(n_sinks, device=device),
                          torch.arange(first, first + self.length + n - lo, device=device)])
        self._rows = self._static("rows", rows)
        first = self._row(self.length)
        self._new_rows = self._static("new_rows", torch.arange(first, first + n, device=device))
        cos, sin = self.rotary.cos_sin(torch.arange(len(pos), device=device), self.k.dtype)
        self._cos, self._sin = self._static("cos", cos), self._static("sin", sin)
        self._qcos, self._qsin = self._cos[-n:], self._sin[-n:]
        self._mask = None if n == 1 else self._static("mask", visibility(pos[None], pos[-n:]))
        self.view_positions = pos

    def graph_key(self):
        """The view's size, once the window is full (before that it grows every step)."""
        full = self.length >= self.sinks + self.window
        return ("streaming", self.sinks + self.window + self.pending) if full else None

    def update(self, layer, q, k, v):
        self.k[layer, :, self._new_rows] = k
        self.v[layer, :, self._new_rows] = v
        keys = self.rotary.rotate(self.k[layer, :, self._rows], self._cos, self._sin)
        q = self.rotary.rotate(q, self._qcos, self._qsin)
        return q, CacheView(keys, self.v[layer, :, self._rows], self._mask, causal=True)

    def commit(self, n: int) -> None:
        assert 0 <= n <= self.pending
        self.length += n
        self.pending = 0

    def truncate(self, length: int) -> None:
        assert length <= self.length
        if self.sinks <= max(min(self.sinks, length), length - self.window) < self.offset:
            raise TforceError("streaming cache rolled back further than it keeps (max_rollback too small)")
        self.length = length

    # Saved states: the cache rolls back only max_rollback tokens, so a conversation that returns to a
    # document's end (or a KV snapshot) restores the state taken there instead.

    def reachable(self, length: int) -> bool:
        """Whether truncate(length) can roll back to that length."""
        return length <= self.length and not (
            self.sinks <= max(min(self.sinks, length), length - self.window) < self.offset)

    def state(self) -> dict:
        """A copy in host memory of what the cache holds: its rows, length and offset."""
        rows = self._row(self.length)
        return {"k": self.k[:, :, :rows].to("cpu", copy=True), "v": self.v[:, :, :rows].to("cpu", copy=True),
                "length": self.length, "offset": self.offset}

    def fits(self, state: dict) -> bool:
        """Whether a state (of this cache's geometry, e.g. from a snapshot) can be restored here."""
        k = state["k"]
        return (k.shape[:2] == self.k.shape[:2] and k.shape[3:] == self.k.shape[3:] and k.dtype == self.k.dtype
                and k.shape[2] <= self.capacity and int(state["offset"]) >= self.sinks)

    def restore(self, state: dict | None) -> None:
        """Hold exactly what state() copied (None: nothing, as when built)."""
        self.pending = 0
        if state is None:
            self.length, self.offset = 0, self.sinks
            return
        rows = state["k"].shape[2]
        self.k[:, :, :rows] = state["k"].to(self.k.device)
        self.v[:, :, :rows] = state["v"].to(self.v.device)
        self.length, self.offset = int(state["length"]), int(state["offset"])
