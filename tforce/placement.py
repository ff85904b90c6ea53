"""Where the target's full KV cache lives: how many layers stay on the GPU, how many stream from host.

Everything else (weights, retrieval cache, small draft and its StreamingLLM cache, two staging
buffers when any layer is offloaded, activations) must be resident; the full cache takes what is left.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import TforceError, UsageError

GiB = 1024 ** 3
OFFLOAD_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Plan:
    n_layers: int
    resident: int  # layers whose KV stays on the GPU
    layer_bytes: int  # K + V of one layer at full capacity
    gpu_bytes: int  # the full cache's device share, staging buffers included
    host_bytes: int  # pinned host memory for the offloaded layers

    @property
    def offloaded(self) -> int:
        return self.n_layers - self.resident

    def describe(self) -> str:
        return (f"{self.resident}/{self.n_layers} layers of KV on the GPU ({self.gpu_bytes / GiB:.1f} GiB), "
                f"{self.offloaded} in pinned host memory ({self.host_bytes / GiB:.1f} GiB)")


def kv_layer_bytes(n_kv: int, head_dim: int, capacity: int, dtype_bytes: int) -> int:
    return 2 * capacity * n_kv * head_dim * dtype_bytes


def plan(n_layers: int, layer_bytes: int, offload: str, gpu_free: int | None, fixed_gpu: int,
         host_free: int) -> Plan:
    """gpu_free: bytes tforce may use on the device (None: no device, e.g. CPU runs);
    fixed_gpu: bytes that must be resident whatever happens (weights, other caches, activations)."""
    if offload not in OFFLOAD_MODES:
        raise UsageError(f"--offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    if offload == "off" or (offload == "auto" and gpu_free is None):
        resident = n_layers
    elif offload == "on":
        resident = 0
    else:
        room = gpu_free - fixed_gpu
        resident = n_layers if room >= n_layers * layer_bytes else max(0, (room - 2 * layer_bytes) // layer_bytes)
    staging = 2 * layer_bytes if resident < n_layers else 0
    p = Plan(n_layers, int(resident), layer_bytes, int(resident * layer_bytes + staging),
             int((n_layers - resident) * layer_bytes))
    if gpu_free is not None and fixed_gpu + p.gpu_bytes > gpu_free:
        raise TforceError(f"not enough GPU memory: {(fixed_gpu + p.gpu_bytes) / GiB:.1f} GiB needed "
                          f"({p.describe()}), {gpu_free / GiB:.1f} GiB available")
    if p.host_bytes > host_free:
        raise TforceError(f"not enough host memory for the offloaded KV cache: {p.host_bytes / GiB:.1f} GiB "
                          f"needed, {host_free / GiB:.1f} GiB available")
    return p
