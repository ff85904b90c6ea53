"""The machine's ceilings, measured once per bench (and by `tforce info` on CUDA): pinned host -> device
copies (CUDA only), the device's memory rate and dense matrix products in the run's dtype (on CUDA with
events, on the CPU with the clock, over torch's threads of the moment). floors.py divides the bytes and
FLOPs a step or a prefill must move or do by these."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.offload import host_tensor
from ..engine.placement import GiB
from ..engine.timing import median_ms


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
    _release(device)  # else the allocator keeps the buffer, and later free-memory figures lack it
    return nbytes / (ms / 1000) / 1e9


CPU_COPY_BYTES = 256 << 20  # well past any CPU's last-level cache; a copy takes tens of milliseconds
CPU_MATMUL_N = 1024


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # as in h2d_peak_gbps


def device_bandwidth_gbps(device, nbytes: int = GiB, repeats: int = 5) -> float | None:
    """Device memory rate in GB/s from a copy within the device (bytes read + written): on CUDA of `nbytes`,
    on the CPU of CPU_COPY_BYTES (or nbytes if smaller); None on other devices."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        return None
    if device.type == "cpu":
        nbytes = min(nbytes, CPU_COPY_BYTES)
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)  # written: its pages exist before the timing
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), device, repeats)
    del a, b
    _release(device)
    return 2 * nbytes / (ms / 1000) / 1e9


def matmul_tflops(device, dtype: torch.dtype, n: int = 8192, repeats: int = 5) -> float | None:
    """Dense n x n x n matrix-product rate in TFLOP/s (median of `repeats`; CUDA events, on the CPU the clock
    with n at most CPU_MATMUL_N); None on other devices."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        return None
    if device.type == "cpu":
        n = min(n, CPU_MATMUL_N)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device, repeats)
    del a, b
    _release(device)
    return 2 * n ** 3 / (ms / 1000) / 1e12


@dataclass
class Ceilings:
    """Measured once per bench: pinned host -> device copies (None off CUDA), device memory, dense matrix
    products in the run's dtype."""

    h2d_gbps: float | None = None
    device_gbps: float | None = None
    tflops: float | None = None

    @classmethod
    def measure(cls, device, dtype: torch.dtype) -> "Ceilings":
        return cls(h2d_peak_gbps(device), device_bandwidth_gbps(device), matmul_tflops(device, dtype))
