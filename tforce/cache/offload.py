"""OffloadedCache: a FullCache whose first `resident` layers live on the device and the rest in host
memory (one tensor per layer, pinned when the device is CUDA), streamed back layer by layer at every forward.

Per forward, for offloaded layer i: its committed K/V [0, length) were copied host -> device into one
of two staging buffers on a copy stream while the previous layer computed; the new tokens' K/V are
written into the staging buffer (the attention reads them from there) and only those rows are copied
back device -> host. Copies are ordered with CUDA events; nothing synchronises the whole device.
On the CPU code path the same steps run as plain copies, so the results are bit-identical to FullCache.
"""
from __future__ import annotations

import weakref

import torch

from ..errors import TforceError
from ..rope import Rotary
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
    """The staging discipline the one-row and the batched offloaded caches share: two device buffers,
    offloaded layer i's committed prefix copied into buffer i % 2 on the copy stream (the class's _prefetch)
    while the layer before it computes."""

    def _slot(self, layer: int) -> int:
        return (layer - self.resident) % 2

    def begin(self, n: int) -> None:
        super().begin(n)
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
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int, rotary: Rotary,
                 resident: int, dtype=torch.float32, device="cpu"):
        self.resident = resident
        self.n_layers = n_layers
        device = torch.device(device)
        cuda = device.type == "cuda"
        # Resident layers, as in FullCache (self.k / self.v hold only them).
        super().__init__(resident, n_kv, head_dim, capacity, rotary, dtype, device)
        self.queries = [None] * n_layers
        # One tensor per offloaded layer (B, S, H_kv, D), page-locked as allocated (host_tensor).
        host_shape = (1, capacity, n_kv, head_dim)
        pin = device if cuda else None
        self.host_k = [host_tensor(host_shape, dtype, pin) for _ in range(n_layers - resident)]
        self.host_v = [host_tensor(host_shape, dtype, pin) for _ in range(n_layers - resident)]
        stage_shape = (2, 1, capacity, n_kv, head_dim)
        self.stage_k = torch.zeros(stage_shape, dtype=dtype, device=device)
        self.stage_v = torch.zeros(stage_shape, dtype=dtype, device=device)
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self._ready = [None, None]  # events: staging buffer j holds its layer's prefix
        self._gather = HostGather(pin)  # page-locked K and V rows for rebuilds

    @property
    def host_bytes(self) -> int:
        """Bytes of host storage, all of them pinned when the device is CUDA (no rounding: host_tensor)."""
        return sum(t.nbytes for t in self.host_k + self.host_v)

    def _prefetch(self, layer: int) -> None:
        """Start copying offloaded `layer`'s committed K/V into its staging buffer."""
        if layer >= self.n_layers:
            return
        j, h, L = self._slot(layer), layer - self.resident, self.length
        # After the compute stream's work so far: the layer that last used this buffer.
        self._ready[j] = copy_on(self.copy_stream, [(self.stage_k[j, :, :L], self.host_k[h][:, :L]),
                                                    (self.stage_v[j, :, :L], self.host_v[h][:, :L])], record=True)

    def update(self, layer, q, k, v):
        if layer < self.resident:
            return super().update(layer, q, k, v)
        L, n = self.length, self.pending
        j, h = self._enter(layer)
        q = self.rotary.rotate(q, self._cos, self._sin)
        self.stage_k[j, :, L:L + n] = self.rotary.rotate(k, self._cos, self._sin)
        self.stage_v[j, :, L:L + n] = v
        self.queries[layer] = q
        self._write_back(j, h, L, n)
        return q, CacheView(self.stage_k[j, :, :L + n], self.stage_v[j, :, :L + n], self._mask, causal=True)

    def _write_back(self, j: int, h: int, L: int, n: int) -> None:
        """Only the new tokens' rows go back to host memory."""
        copy_on(self.copy_stream, [(self.host_k[h][:, L:L + n], self.stage_k[j, :, L:L + n]),
                                   (self.host_v[h][:, L:L + n], self.stage_v[j, :, L:L + n])])

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer-major prefill hands over one layer: an offloaded one goes to host memory once."""
        if layer < self.resident:
            return super().write_layer(layer, k, v)
        L, n, h = self.length, k.shape[1], layer - self.resident
        # Synchronous on purpose: the caller reuses k and v's storage for the next layer right away.
        self.host_k[h][:, L:L + n].copy_(k)
        self.host_v[h][:, L:L + n].copy_(v)

    def layer_keys(self, layer: int) -> torch.Tensor:
        """Committed keys (B, S, H_kv, D) of one layer, wherever they live (for retrieval rebuilds)."""
        if layer < self.resident:
            return self.k[layer]
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        return self.host_k[layer - self.resident]

    def layer_values(self, layer: int) -> torch.Tensor:
        if layer < self.resident:
            return self.v[layer]
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        return self.host_v[layer - self.resident]

    # Reads for retrieval rebuilds: an offloaded layer's rows come from host memory, counted in
    # host_rows_read (token rows of one layer, K and V together; per-forward streaming is not counted).
    host_rows_read = 0

    def kv_home(self, layer: int) -> torch.device:
        return super().kv_home(layer) if layer < self.resident else self.host_k[layer - self.resident].device

    def read_keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        if layer < self.resident:
            return super().read_keys(layer, start, end)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # write-backs of the last forward
        self.host_rows_read += end - start
        return self.host_k[layer - self.resident][:, start:end]

    def gather_rows(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered in host memory: only the selected rows cross to the device (the caller moves them)."""
        if layer < self.resident:
            return super().gather_rows(layer, idx)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        h, idx = layer - self.resident, idx.cpu()
        self.host_rows_read += idx.shape[0]
        return self._gather(self.host_k[h], idx, 0), self._gather(self.host_v[h], idx, 1)
