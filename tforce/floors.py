"""Physical floors beside bench's figures (DESIGN.md habit 9): what a step or a prefill cannot beat on
this device, from bytes that must be read or FLOPs that must be done over a measured ceiling.

- A decode step of a node reads its weights and its KV cache once: (weight bytes + layers x KV bytes per
  token x tokens attended) / the device's measured memory rate. The weights a step reads are the layers,
  the final norm and the output projection: of an untied input embedding table it reads one row per
  token (a Llama-68M draft's table is a third of its bytes), so the table is not counted. The full node
  attends the whole context, the middle node its budget, the small draft its StreamingLLM budget. (The
  offloaded full cache's other floor, bytes over the PCIe copy rate, is bench's floor_ms_per_verification.)
- A prefill of n tokens does 2 x (parameters in the layers) x n FLOPs in matrix products plus causal
  attention's 2 x n^2 x heads x head_dim per layer (QK^T and PV, each n^2/2 x heads x head_dim
  multiply-adds), at the device's measured dense matrix-product rate in the run's dtype. The vocabulary
  projection is counted for one token.
Ceilings are measured on CUDA only: on the CPU they return None and no floor is given.
"""
from __future__ import annotations

import torch

from .config import Speculation
from .placement import weight_bytes
from .timing import median_ms


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


def _layer_params(config) -> int:
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    return n * (2 * h * heads * d + 2 * h * kv * d + 3 * h * i)


def prefill_flops(config, n: int) -> float:
    """FLOPs of a causal prefill of n tokens (module docstring)."""
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = config.num_hidden_layers * 2 * n * n * heads * d  # heads x head_dim: hidden in Llama-2
    return 2 * _layer_params(config) * n + attention + 2 * config.hidden_size * config.vocab_size


def _kv_token_bytes(config, dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv * d * dtype_bytes


def step_weight_bytes(config, dtype_bytes: int) -> int:
    """Weight bytes one decode step reads (module docstring): all of them but an untied input embedding table."""
    tied = getattr(config, "tie_word_embeddings", False)
    return weight_bytes(config, dtype_bytes) - (0 if tied else dtype_bytes * config.vocab_size * config.hidden_size)


def step_floors_ms(config, draft_config, dtype_bytes: int, spec: Speculation, context: float,
                   bandwidth_gbps: float | None) -> dict[str, float] | None:
    """Per node of the method, the ms one decode step must take to read its weights and attended KV at
    the measured device rate; context: the full node's mean attended tokens. None without a rate."""
    if not bandwidth_gbps:
        return None
    target = step_weight_bytes(config, dtype_bytes)
    per_token = _kv_token_bytes(config, dtype_bytes)
    floors = {"full": target + per_token * context}
    if spec.method in ("triforce", "retrieval"):
        floors["retrieval"] = target + per_token * min(spec.budget, context)
    if spec.method == "streaming":
        floors["streaming"] = target + per_token * min(spec.budget, context)
    if spec.uses_draft and draft_config is not None:
        floors["draft"] = step_weight_bytes(draft_config, dtype_bytes) + \
            _kv_token_bytes(draft_config, dtype_bytes) * min(spec.draft_budget, context)
    return {name: 1000 * b / (bandwidth_gbps * 1e9) for name, b in floors.items()}
