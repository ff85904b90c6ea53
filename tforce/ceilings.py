"""The machine's ceilings, measured once per bench and by `tforce info` on CUDA (None elsewhere): pinned
host -> device copies, device memory, dense matrix products in the run's dtype. floors.py divides the
bytes and FLOPs a step or a prefill must move or do by these."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache.offload import host_tensor
from .placement import GiB
from .timing import median_ms


def h2d_peak_gbps(device, nbytes: int = GiB, repeats: int = 5) -> float | None:
    """Pinned host -> device copy rate in GB/s (1e9 bytes/s), median of `repeats`, timed with CUDA events;
    None off CUDA. The host buffer is pinned as the offloaded KV cache's are (cache/offload.host_tensor),
    which also unpins it when freed: PyTorch's pinned allocator would keep 1 GiB page-locked for the rest
    of the process (empty_cache does not release it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    host = host_tensor((nbytes,), torch.uint8, device)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = median_ms(lambda: dev.copy_(host, non_blocking=True), device, repeats)
    del host, dev
    torch.cuda.empty_cache()  # else the allocator keeps the buffer, and later free-memory figures lack it
    return nbytes / (ms / 1000) / 1e9


def device_bandwidth_gbps(device, nbytes: int = GiB, repeats: int = 5) -> float | None:
    """Device memory rate in GB/s from a device-to-device copy (bytes read + written); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), device, repeats)
    del a, b
    torch.cuda.empty_cache()  # as in h2d_peak_gbps
    return 2 * nbytes / (ms / 1000) / 1e9


def matmul_tflops(device, dtype: torch.dtype, n: int = 8192, repeats: int = 5) -> float | None:
    """Dense n x n x n matrix-product rate in TFLOP/s (median of `repeats`, CUDA events); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device, repeats)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (ms / 1000) / 1e12


@dataclass
class Ceilings:
    """Measured once per bench on CUDA (None elsewhere): pinned host -> device copies, device memory,
    dense matrix products in the run's dtype."""

    h2d_gbps: float | None = None
    device_gbps: float | None = None
    tflops: float | None = None

    @classmethod
    def measure(cls, device, dtype: torch.dtype) -> "Ceilings":
        return cls(h2d_peak_gbps(device), device_bandwidth_gbps(device), matmul_tflops(device, dtype))
