"""RowsOffloadedCache: RowsCache (cache/batched.py) whose first `resident` layers live on the device and
the rest in host memory (one (B, S, H_kv, D) tensor per layer, pinned on CUDA), streamed back layer by
layer at every forward for all rows at once: the weights and each offloaded layer cross once per step
for the whole batch.

Per forward, for offloaded layer i, as OffloadedCache (cache/offload.py) does for one row: each live row's
committed K/V [0, lengths[b]) are copied host -> device into one of two staging buffers on a copy stream
while the previous layer computes (one copy per row: exactly its bytes, never another row's unused tail);
the new tokens' K/V are written into the staging buffer and only those rows go back device -> host.
A batch's prefill is layer-major (prefill.py, prefill_rows_layer_major): write_layer sends each row's
prompt K/V of an offloaded layer to host memory once, nothing streams back during the prefill.
On the CPU code path the same steps run as plain copies, so the results are bit-identical to RowsCache.
Untested on CUDA.
"""
from __future__ import annotations

import torch

from ..rope import Rotary
from .base import CacheView
from .batched import RowsCache
from .offload import HostGather, StagedLayers, copy_on, host_tensor


class RowsOffloadedCache(StagedLayers, RowsCache):
    def __init__(self, n_layers: int, n_rows: int, n_kv: int, head_dim: int, capacity: int, rotary: Rotary,
                 resident: int, dtype=torch.float32, device="cpu"):
        device = torch.device(device)
        cuda = device.type == "cuda"
        super().__init__(resident, n_rows, n_kv, head_dim, capacity, rotary, dtype, device)  # resident layers
        self.resident, self.n_layers = resident, n_layers
        shape, pin = (n_rows, capacity, n_kv, head_dim), device if cuda else None
        self.host_k = [host_tensor(shape, dtype, pin) for _ in range(n_layers - resident)]
        self.host_v = [host_tensor(shape, dtype, pin) for _ in range(n_layers - resident)]
        self.stage_k = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.stage_v = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self._ready = [None, None]  # events: staging buffer j holds its layer's prefixes
        self._gather = HostGather(pin)  # page-locked K and V rows for rebuilds

    def _prefetch(self, layer: int) -> None:
        """Start copying offloaded `layer`'s committed K/V, row by row, into its staging buffer."""
        if layer >= self.n_layers:
            return
        j, h = self._slot(layer), layer - self.resident
        pairs = []
        for b in range(self.rows):
            L = int(self.lengths[b])
            pairs += [(self.stage_k[j, b, :L], self.host_k[h][b, :L]), (self.stage_v[j, b, :L], self.host_v[h][b, :L])]
            self.host_rows_streamed += L
        self._ready[j] = copy_on(self.copy_stream, pairs, record=True)

    def update(self, layer, q, k, v):
        if layer < self.resident:
            return super().update(layer, q, k, v)
        j, h = self._enter(layer)
        q = self.rotary.rotate(q, self._cos, self._sin)
        self._fresh[layer] = q
        self.stage_k[j][self._rows_idx, self._slots] = self.rotary.rotate(k, self._cos, self._sin)
        self.stage_v[j][self._rows_idx, self._slots] = v
        self._write_back(j, h)
        B, S = self.rows, self._S
        return q, CacheView(self.stage_k[j, :B, :S], self.stage_v[j, :B, :S], self._mask)

    def _write_back(self, j: int, h: int) -> None:
        """Only the new tokens' rows go back to host memory, row by row."""
        n = self.pending
        pairs = []
        for b in range(self.rows):
            L = int(self.lengths[b])
            pairs += [(self.host_k[h][b, L:L + n], self.stage_k[j, b, L:L + n]),
                      (self.host_v[h][b, L:L + n], self.stage_v[j, b, L:L + n])]
        self.host_rows_written += self.rows * n
        copy_on(self.copy_stream, pairs)

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts: list[int]) -> None:
        """Layer-major prefill hands over one layer: an offloaded one goes to host memory once, each row's
        counts[b] rows exactly (one copy per row, as _write_back)."""
        if layer < self.resident:
            return super().write_layer(layer, k, v, counts)
        h = layer - self.resident
        for b, n in enumerate(counts):
            L = int(self.lengths[b])
            # Synchronous on purpose: the caller reuses k and v's storage for the next layer right away.
            self.host_k[h][b, L:L + n].copy_(k[b, :n])
            self.host_v[h][b, L:L + n].copy_(v[b, :n])
            self.host_rows_written += n

    # PCIe traffic of the offloaded layers, in token rows of one row and layer (K and V together):
    # host_rows_streamed, host -> device at each forward (every live row's committed prefix, _prefetch);
    # host_rows_written, device -> host (a forward's new rows of every live row, padding included, and
    # the layer-major prefill's rows); host_rows_read, rebuild reads of host memory (only the selected
    # rows cross to the device).
    host_rows_streamed = host_rows_written = host_rows_read = 0

    def kv_home(self, layer: int) -> torch.device:
        return super().kv_home(layer) if layer < self.resident else self.host_k[layer - self.resident].device

    def read_row_keys(self, layer: int, b: int, start: int, end: int) -> torch.Tensor:
        if layer < self.resident:
            return super().read_row_keys(layer, b, start, end)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # write-backs of the last forward
        self.host_rows_read += end - start
        return self.host_k[layer - self.resident][b:b + 1, start:end]

    def gather_row(self, layer: int, b: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer < self.resident:
            return super().gather_row(layer, b, idx)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        h, idx = layer - self.resident, idx.cpu()
        self.host_rows_read += idx.shape[0]
        return self._gather(self.host_k[h][b:b + 1], idx, 0), self._gather(self.host_v[h][b:b + 1], idx, 1)

    def keep(self, rows: list[int]) -> None:
        """RowsCache.keep; the host layers' rows follow, once no copy still reads or writes them."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        super().keep(rows)

    def _move_row(self, i: int, j: int) -> None:
        super()._move_row(i, j)
        n = self._used(i)
        for x in self.host_k + self.host_v:
            x[j, :n] = x[i, :n]
