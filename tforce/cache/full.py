"""FullCache: every token's K/V at its own position; the verifier's cache and the oracle for the others."""
from __future__ import annotations

import torch

from ..errors import TforceError
from ..rope import Rotary
from .base import CacheView, visibility


class FullCache:
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int, rotary: Rotary,
                 dtype=torch.float32, device="cpu"):
        shape = (n_layers, 1, capacity, n_kv, head_dim)  # per layer (B, S, H_kv, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.rotary = rotary
        self.length = 0
        self.pending = 0
        # Rotated queries of the last forward, kept to rebuild a retrieval cache from (per layer
        # (B, T, H_q, D)), and the sequence positions they belong to.
        self.queries: list[torch.Tensor | None] = [None] * n_layers
        self.query_pos = torch.empty(0, dtype=torch.long)

    def begin(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise TforceError(f"KV cache full: {self.length} + {n} tokens > capacity {self.capacity}")
        self.pending = n
        L, device = self.length, self.k.device
        # On the host, for query_at (retrieval rebuilds): no device -> host copy to read it back.
        self.query_pos = torch.arange(L, L + n)
        pos = torch.arange(L, L + n, device=device)  # built on the device: no host -> device copy
        self._cos, self._sin = self.rotary.cos_sin(pos, self.k.dtype)
        # One new token sees everything before it: no mask needed.
        self._mask = None if n == 1 else visibility(torch.arange(L + n, device=device)[None], pos)

    def update(self, layer, q, k, v):
        L, n = self.length, self.pending
        q = self.rotary.rotate(q, self._cos, self._sin)
        self.k[layer, :, L:L + n] = self.rotary.rotate(k, self._cos, self._sin)
        self.v[layer, :, L:L + n] = v
        self.queries[layer] = q
        return q, CacheView(self.k[layer, :, :L + n], self.v[layer, :, :L + n], self._mask, causal=True)

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's rotated K/V (B, n, H_kv, D) after the committed tokens, outside a forward
        (layer-major prefill); commit_written(n) then commits them for every layer at once."""
        L, n = self.length, k.shape[1]
        self.k[layer, :, L:L + n] = k
        self.v[layer, :, L:L + n] = v

    def commit_written(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise TforceError(f"KV cache full: {self.length} + {n} tokens > capacity {self.capacity}")
        self.length += n

    def commit(self, n: int) -> None:
        assert 0 <= n <= self.pending
        self.length += n
        self.pending = 0

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length

    def layer_keys(self, layer: int) -> torch.Tensor:
        """Keys (B, S, H_kv, D) of one layer, committed ones first (for retrieval rebuilds)."""
        return self.k[layer]

    def layer_values(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def query_at(self, layer: int, position: int) -> torch.Tensor:
        """The rotated query (H_q, D) of the last forward at a sequence position."""
        i = position - int(self.query_pos[0])
        assert 0 <= i < len(self.query_pos), "no stored query at that position"
        return self.queries[layer][0, i]

    # Reads for retrieval rebuilds (cache/retrieval.py, cache/chunkstats.py): rows, never whole layers.

    def kv_home(self, layer: int) -> torch.device:
        """Where a layer's K/V live (its chunk statistics live there too)."""
        return self.k.device

    def read_keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Keys (B, end - start, H_kv, D) of positions [start, end), on the layer's home device."""
        return self.k[layer, :, start:end]

    def gather_rows(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx (n, H_kv) positions -> K, V (B, n, H_kv, D): for each KV head, the rows at its positions."""
        idx = idx.to(self.k.device)
        return gather_heads(self.k[layer], idx), gather_heads(self.v[layer], idx)


def gather_heads(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, S, H_kv, D), idx (n, H_kv) on x's device -> (B, n, H_kv, D)."""
    B, _, H, D = x.shape
    return x.gather(1, idx[None, :, :, None].expand(B, idx.shape[0], H, D))
