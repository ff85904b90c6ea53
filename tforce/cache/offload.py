"""OffloadedCache: a FullCache whose first `resident` layers live on the device and the rest in host
memory (one (B, S, H_kv, D) tensor per layer, pinned when the device is CUDA), streamed back layer by layer
at every forward for all rows at once: the weights and each offloaded layer cross once per step for the
whole batch.

Per forward, for offloaded layer i: every live row's committed K/V [0, lengths[b]) were copied host ->
device into one of two staging buffers on a copy stream while the previous layer computed (one copy per
row, exactly its bytes, each a contiguous run of memory, never another row's unused tail: _spans);
the new tokens' K/V are written into the staging buffer (the attention reads them from there) and only
those tokens go back device -> host. Copies are ordered with CUDA events; nothing synchronises the whole
device. The prefill is layer-major (prefill.py): write_layer sends each row's prompt K/V of an offloaded
layer to host memory once, nothing streams back during the prefill.
On the CPU code path the same steps run as plain copies, so the results are bit-identical to FullCache.
"""
from __future__ import annotations

import weakref

import torch

from ..errors import TforceError
from .rope import Rotary
from .base import CacheView
from .full import FullCache


def host_tensor(shape: tuple, dtype: torch.dtype, pin_for: torch.device | None = None) -> torch.Tensor:
    """A zeroed host tensor; with pin_for (a CUDA device), page-locked in place by cudaHostRegister.

    Not pin_memory=True: PyTorch's pinned allocator rounds every block up to a power of two (a 28.2 GiB
    buffer takes 32 GiB, a layer of 1.01 GiB takes 2), while registering ordinary memory pins exactly
    its bytes, which is what the planner checks against the host's free memory. Unregistered when
    the tensor is freed, once the device's pending copies are done."""
    t = torch.zeros(shape, dtype=dtype)
    if pin_for is not None:
        ptr = t.data_ptr()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, t.nbytes, 0))
        if err:
            _clear_last_error()
            raise TforceError(f"cannot pin {t.nbytes / 2**30:.2f} GiB of host memory "
                              f"(cudaHostRegister error {err})")
        weakref.finalize(t, _unregister, ptr, pin_for).atexit = False  # at exit the process frees it all
    return t


def _clear_last_error() -> None:
    """Read (and so reset) the CUDA runtime's last error after a failed cudaHostRegister: left set, PyTorch's
    check after the next kernel launch (cudaGetLastError) would report it as that kernel's failure. torch's
    cudart binding may lack cudaGetLastError; the runtime torch loaded is then reached through ctypes."""
    get = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if get is None:
        import ctypes

        try:
            get = ctypes.CDLL(None).cudaGetLastError  # libcudart, loaded by torch into the global namespace
        except (AttributeError, OSError):
            return
    get()


def copy_on(stream: "torch.cuda.Stream | None", pairs, record: bool = False) -> "torch.cuda.Event | None":
    """Copy each (dst, src) pair: plainly without a stream (the CPU code path); else on `stream`, after the
    compute stream's work so far (whatever last used dst), non-blocking, and with record=True return an
    event recorded after the copies, for the compute stream to wait on."""
    if stream is None:
        for dst, src in pairs:
            dst.copy_(src)
        return None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
    if not record:
        return None
    done = torch.cuda.Event()
    done.record(stream)
    return done


def _unregister(ptr: int, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy may still read or write the pages
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostGather:
    """gather_heads of host-memory K/V rows into reused host buffers (one per `which`: K and V), page-locked
    with pin_for (a CUDA device) so that the rows cross to the device by DMA: gathered into fresh ordinary
    memory they went through a pageable bounce ("Memcpy HtoD (Pageable -> Device)" in every rebuild of a
    profile on an H100). The result is a view of the buffer: the caller copies the rows out before the
    next call with the same `which` (the retrieval caches' _fill do, synchronously)."""

    def __init__(self, pin_for: torch.device | None):
        self.pin_for = pin_for
        self.bufs: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, which: int) -> torch.Tensor:
        """x (B, S, H_kv, D) in host memory, idx (n, H_kv) host positions -> (B, n, H_kv, D)."""
        B, _, H, D = x.shape
        n = idx.shape[0]
        buf = self.bufs.get(which)
        if buf is None or buf.shape[1] < n:
            buf = self.bufs[which] = host_tensor((B, n, H, D), x.dtype, self.pin_for)
        out = buf[:, :n]
        torch.gather(x, 1, idx[None, :, :, None].expand(B, n, H, D), out=out)
        return out


class StagedLayers:
    """The staging discipline: two device buffers, offloaded layer i's committed prefix copied into buffer
    i % 2 on the copy stream (the class's _prefetch) while the layer before it computes."""

    def _slot(self, layer: int) -> int:
        return (layer - self.resident) % 2

    def begin(self, n: int, counts: list[int] | None = None) -> None:
        super().begin(n, counts)
        self._prefetch(self.resident)

    def _enter(self, layer: int) -> tuple[int, int]:
        """Wait (on the compute stream, not the host) until offloaded `layer` is staged, start staging the
        next one; returns (staging buffer, index into host_k/host_v)."""
        j = self._slot(layer)
        if self._ready[j] is not None:
            torch.cuda.current_stream(self.stage_k.device).wait_event(self._ready[j])
        self._prefetch(layer + 1)  # overlaps with this layer's compute
        return j, layer - self.resident


class OffloadedCache(StagedLayers, FullCache):
    alone_rows = False  # every forward stages every row's layer: a joining row's prefill pads the others

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int, rotary: Rotary,
                 resident: int, dtype=torch.float32, device="cpu", rows: int = 1):
        device = torch.device(device)
        cuda = device.type == "cuda"
        # Resident layers, as in FullCache (self.k / self.v hold only them).
        super().__init__(resident, n_kv, head_dim, capacity, rotary, dtype, device, rows)
        self.resident, self.n_layers = resident, n_layers
        # One tensor per offloaded layer (B, S, H_kv, D), page-locked as allocated (host_tensor).
        shape, pin = (rows, capacity, n_kv, head_dim), device if cuda else None
        self.host_k = [host_tensor(shape, dtype, pin) for _ in range(n_layers - resident)]
        self.host_v = [host_tensor(shape, dtype, pin) for _ in range(n_layers - resident)]
        self.stage_k = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.stage_v = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self._ready = [None, None]  # events: staging buffer j holds its layer's prefixes
        self._gather = HostGather(pin)  # page-locked K and V rows for rebuilds

    @property
    def host_bytes(self) -> int:
        """Bytes of host storage, all of them pinned when the device is CUDA (no rounding: host_tensor)."""
        return sum(t.nbytes for t in self.host_k + self.host_v)

    def _spans(self, n: int) -> list[tuple[slice, int, int]]:
        """(rows, first, end) blocks that together cover each live row's [lengths[b], lengths[b] + n), each
        block one contiguous run of memory: one row, or all rows when the span is the whole capacity.

        Why not one block for rows of one length: rows 0..B of [0, L) with L < capacity are B strided runs,
        and a non-contiguous copy between host and device is made contiguous first in pageable host memory
        and crosses synchronously: on an H200, 4 offloaded rows of 2,048 tokens took 1,425 ms a forward
        against 54 ms for one row (BENCHMARKS.md, GPU log, 2026-11-28)."""
        lo, hi = self.span()
        if lo == hi and (self.rows == 1 or (lo == 0 and n == self.capacity)):
            return [(slice(0, self.rows), lo, lo + n)]
        return [(slice(b, b + 1), L, L + n) for b, L in enumerate(self.lengths[:self.rows])]

    def _prefetch(self, layer: int) -> None:
        """Start copying offloaded `layer`'s committed K/V into its staging buffer."""
        if layer >= self.n_layers:
            return
        j, h = self._slot(layer), layer - self.resident
        pairs = []
        for rows, _, L in self._spans(0):
            pairs += [(self.stage_k[j, rows, :L], self.host_k[h][rows, :L]),
                      (self.stage_v[j, rows, :L], self.host_v[h][rows, :L])]
        self.host_rows_streamed += sum(self.lengths[:self.rows])
        # After the compute stream's work so far: the layer that last used this buffer.
        self._ready[j] = copy_on(self.copy_stream, pairs, record=True)

    def update(self, layer, q, k, v):
        if layer < self.resident:
            return super().update(layer, q, k, v)
        j, h = self._enter(layer)
        q = self.rotary.rotate(q, self._cos, self._sin)
        self._fresh[layer] = q
        self._write(self.stage_k[j], self.stage_v[j], self.rotary.rotate(k, self._cos, self._sin), v)
        self._write_back(j, h)
        B, S = self.rows, self._S
        return q, CacheView(self.stage_k[j, :B, :S], self.stage_v[j, :B, :S], self._mask,
                            causal=self._causal, seqlens=self._seqlens)

    def _write_back(self, j: int, h: int) -> None:
        """Only the new tokens go back to host memory."""
        pairs = []
        for rows, a, e in self._spans(self.pending):
            pairs += [(self.host_k[h][rows, a:e], self.stage_k[j, rows, a:e]),
                      (self.host_v[h][rows, a:e], self.stage_v[j, rows, a:e])]
        self.host_rows_written += self.rows * self.pending
        copy_on(self.copy_stream, pairs)

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, counts: list[int] | None = None) -> None:
        """Layer-major prefill hands over one layer: an offloaded one goes to host memory once, each row's
        counts[b] tokens exactly (one copy per row)."""
        if layer < self.resident:
            return super().write_layer(layer, k, v, counts)
        h = layer - self.resident
        for b, n in enumerate(counts if counts is not None else [k.shape[1]] * self.rows):
            L = self.lengths[b]
            # Synchronous on purpose: the caller reuses k and v's storage for the next layer right away.
            self.host_k[h][b, L:L + n].copy_(k[b, :n])
            self.host_v[h][b, L:L + n].copy_(v[b, :n])
            self.host_rows_written += n

    def _synced(self) -> None:
        """Wait for the copy stream (the write-backs of the last forward) before the host reads or moves rows."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def layer_keys(self, layer: int) -> torch.Tensor:
        """Committed keys (B, S, H_kv, D) of one layer, wherever they live (for retrieval rebuilds)."""
        if layer < self.resident:
            return self.k[layer]
        self._synced()
        return self.host_k[layer - self.resident]

    def layer_values(self, layer: int) -> torch.Tensor:
        if layer < self.resident:
            return self.v[layer]
        self._synced()
        return self.host_v[layer - self.resident]

    # PCIe traffic of the offloaded layers, in tokens of one row and layer (K and V together):
    # host_rows_streamed, host -> device at each forward (every live row's committed prefix, _prefetch);
    # host_rows_written, device -> host (a forward's new tokens of every live row, padding included, and
    # the layer-major prefill's); host_rows_read, rebuild reads of host memory (only the selected tokens
    # cross to the device).
    host_rows_streamed = host_rows_written = host_rows_read = 0

    def kv_home(self, layer: int) -> torch.device:
        return super().kv_home(layer) if layer < self.resident else self.host_k[layer - self.resident].device

    def read_keys(self, layer: int, start: int, end: int, row: int = 0) -> torch.Tensor:
        if layer < self.resident:
            return super().read_keys(layer, start, end, row)
        self._synced()
        self.host_rows_read += end - start
        return self.host_k[layer - self.resident][row:row + 1, start:end]

    def gather_rows(self, layer: int, idx: torch.Tensor, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered in host memory: only the selected tokens cross to the device (the caller moves them)."""
        if layer < self.resident:
            return super().gather_rows(layer, idx, row)
        self._synced()
        h, idx = layer - self.resident, idx.cpu()
        self.host_rows_read += idx.shape[0]
        return (self._gather(self.host_k[h][row:row + 1], idx, 0),
                self._gather(self.host_v[h][row:row + 1], idx, 1))

    def keep(self, rows: list[int]) -> None:
        """FullCache.keep; the host layers' rows follow, once no copy still reads or writes them."""
        self._synced()
        super().keep(rows)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """FullCache.copy_prefix; the host layers' rows too, once no copy still reads or writes them."""
        self._synced()
        super().copy_prefix(src, dst, n)
        for x in self.host_k + self.host_v:
            x[dst, :n] = x[src, :n]

    def _move_row(self, i: int, j: int) -> None:
        super()._move_row(i, j)
        n = self._used(i)
        for x in self.host_k + self.host_v:
            x[j, :n] = x[i, :n]
