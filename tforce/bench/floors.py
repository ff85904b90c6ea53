"""Physical floors beside bench's figures (docs/architecture.md, "Measurements"): what a step or a prefill cannot
beat on this device, from bytes that must be read or FLOPs that must be done over a measured ceiling.

- A decode step of a node reads its weights and its KV cache once: (weight bytes + layers x KV bytes per
  token x tokens attended x rows fed) / the device's measured memory rate (a batch's forward reads the
  weights once for all its rows, each row's own KV). The weights a step reads are the layers,
  the final norm and the output projection: of an untied input embedding table it reads one row per
  token (a Llama-68M draft's table is a third of its bytes), so the table is not counted. The full node
  attends the whole context, the middle node its budget, the small draft its StreamingLLM budget. (The
  offloaded full cache's other floor, bytes over the PCIe copy rate, is bench's floor_ms_per_verification.)
- A prefill of n tokens does 2 x (parameters in the layers) x n FLOPs in matrix products plus causal
  attention's 2 x n^2 x heads x head_dim per layer (QK^T and PV, each n^2/2 x heads x head_dim
  multiply-adds), at the device's measured dense matrix-product rate in the run's dtype. The vocabulary
  projection is counted for one token.
The ceilings (ceilings.py) are measured on CUDA and on the CPU (the CPU's memory copy rate and matrix
products over the threads of the moment); on other devices they are None and no floor is given.
"""
from __future__ import annotations

from ..config import Speculation
from ..engine.placement import Shape, weight_bytes


def prefill_flops(config, n: int) -> float:
    """FLOPs of a causal prefill of n tokens (module docstring)."""
    s = Shape.of(config, 1)
    layer_params = 2 * s.hidden * (s.heads + s.kv_heads) * s.head_dim + 3 * s.hidden * s.intermediate
    attention = 2 * n * n * s.heads * s.head_dim  # per layer; heads x head_dim is the hidden size in Llama-2
    return s.layers * (2 * layer_params * n + attention) + 2 * s.hidden * s.vocab


def step_weight_bytes(config, dtype_bytes: int, world: int = 1) -> int:
    """Weight bytes one decode step reads on one of `world` ranks (module docstring): all of that rank's
    but an untied input embedding table, which every rank holds whole."""
    tied = getattr(config, "tie_word_embeddings", False)
    table = 0 if tied else dtype_bytes * config.vocab_size * config.hidden_size
    return weight_bytes(config, dtype_bytes, world) - table


def step_floors_ms(config, draft_config, dtype_bytes: int, spec: Speculation, context: float,
                   bandwidth_gbps: float | None, rows: dict[str, float] | None = None,
                   target_weights: int | None = None) -> dict[str, float] | None:
    """Per node of the method, the ms one decode step must take to read its weights and attended KV at
    the measured device rate; context: the full node's mean attended tokens per row; rows: per node, the
    rows a forward feeds (a batch's mean; default one); target_weights: the target's weight bytes per
    step where they are not dtype_bytes per parameter (quantized projections). None without a rate."""
    if not bandwidth_gbps:
        return None
    target = step_weight_bytes(config, dtype_bytes) if target_weights is None else target_weights
    per_token = _kv_token_bytes(config, dtype_bytes)
    floors = {"full": (target, per_token * context)}  # (weights, one row's KV)
    if spec.middle is not None:  # "retrieval" or "streaming": the target's weights over the middle cache
        floors[spec.middle] = (target, per_token * min(spec.budget, context))
    if spec.uses_draft and draft_config is not None:
        floors["draft"] = (step_weight_bytes(draft_config, dtype_bytes),
                           _kv_token_bytes(draft_config, dtype_bytes) * min(spec.draft_budget, context))
    rows = rows or {}
    return {name: 1000 * (w + kv * rows.get(name, 1)) / (bandwidth_gbps * 1e9) for name, (w, kv) in floors.items()}


def _kv_token_bytes(config, dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    s = Shape.of(config, dtype_bytes)
    return s.layers * s.layer_kv_per_token
