"""How tensor parallelism splits a built model, applied from outside (gpt-fast's `apply_tp`): check_tp,
apply_tp, and tp_slices (the part of each checkpoint tensor a rank reads). Apart from parallel/tp.py, which
runs a generation over the ranks: this is all a rank needs to hold its shard, and all weights.py needs.

Layout (Megatron): each rank holds a contiguous block of KV heads together with the query heads of their
GQA groups (q/k/v_proj column-parallel), the matching input columns of o_proj (row-parallel), and a block
of the MLP's intermediate features (gate/up_proj column-parallel, down_proj row-parallel). An all_reduce
after o_proj and after down_proj gives every rank the full hidden state; embeddings and lm_head are
replicated, so every rank computes the full logits. Each rank's caches hold only its KV heads (the model
reads its head count from k_proj), so with offloading each GPU streams its half over its own PCIe link.
Biases follow their weights: q/k/v's are split with them, o_proj's is added on rank 0 only. Qwen3's
q_norm and k_norm act on each head over head_dim, whatever the head count: whole on every rank.

Loading: each rank reads from the safetensors files only its slice of every sharded weight
(`tp_slices`, used by weights.load_model(rank=, world=)); embeddings, norms (q_norm, k_norm too) and lm_head
whole."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from .families import kv_heads


def check_tp(config, world: int) -> None:
    """UsageError (one line) unless the model's heads and MLP split evenly over `world` ranks."""
    if world < 1:
        raise UsageError(f"tensor parallelism needs at least 1 rank, got {world}")
    heads, kv = config.num_attention_heads, kv_heads(config)
    if kv % world or heads % world:
        raise UsageError(f"cannot split {heads} query heads and {kv} KV heads over {world} ranks: "
                         f"both must divide by {world}")
    if config.intermediate_size % world:
        raise UsageError(f"cannot split the MLP's {config.intermediate_size} features over {world} ranks")


def _shard_rows(linear: nn.Linear, start: int, end: int) -> None:
    """Column-parallel: keep output features [start, end) (weight rows and bias)."""
    linear.weight = nn.Parameter(linear.weight.data[start:end].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _shard_cols(linear: nn.Linear, start: int, end: int, rank: int) -> None:
    """Row-parallel: keep input features [start, end); the bias stays on rank 0 only, so the sum adds it once."""
    linear.weight = nn.Parameter(linear.weight.data[:, start:end].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = end - start
    linear.register_forward_hook(_all_reduce_output)


def _all_reduce_output(module, inputs, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)  # sum of the ranks' partial products; identical bits on every rank
    return output


def _layer_cuts(layer, rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """One decoder layer's sharded linears -> (dim, start, end): the weight slice rank keeps (dim 0:
    output features, column-parallel; dim 1: input features, row-parallel). Read from the unsharded layer."""
    attn, mlp = layer.self_attn, layer.mlp
    d = attn.head_dim
    n_q, n_kv = attn.n_heads // world, attn.n_kv // world  # local heads; GQA groups stay whole
    f = mlp.gate_proj.out_features // world
    q, kv, ff = (rank * n_q * d, (rank + 1) * n_q * d), (rank * n_kv * d, (rank + 1) * n_kv * d), \
        (rank * f, (rank + 1) * f)
    return {"self_attn.q_proj": (0, *q), "self_attn.k_proj": (0, *kv), "self_attn.v_proj": (0, *kv),
            "self_attn.o_proj": (1, *q), "mlp.gate_proj": (0, *ff), "mlp.up_proj": (0, *ff),
            "mlp.down_proj": (1, *ff)}


def tp_slices(model, rank: int, world: int) -> dict[str, tuple[int, int, int] | None]:
    """Checkpoint tensor name -> (dim, start, end) of the part rank keeps under apply_tp, or None for a
    tensor it drops (a row-parallel bias off rank 0); tensors not named are replicated whole. Read from
    an unsharded model (the meta device will do): weights.load_model reads only these slices."""
    model = getattr(model, "model", model) if not isinstance(model, nn.Module) else model
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name, (dim, start, end) in _layer_cuts(layer, rank, world).items():
            prefix = f"model.layers.{i}.{name}"
            out[f"{prefix}.weight"] = (dim, start, end)
            if layer.get_submodule(name).bias is None:
                continue
            if dim == 0:
                out[f"{prefix}.bias"] = (0, start, end)
            elif rank != 0:  # row-parallel: the sum over ranks adds rank 0's whole bias once
                out[f"{prefix}.bias"] = None
    return out


def apply_tp(model, rank: int, world: int):
    """Shard a built tforce Llama in place for rank `rank` of `world`; returns it. world == 1: unchanged.
    Works on a model on the meta device too (shapes only; weights.load_model then assigns the slices).

    The process group must be initialised before the model's first forward (not before this call)."""
    model = getattr(model, "model", model) if not isinstance(model, nn.Module) else model
    check_tp(model.config, world)
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is outside 0..{world - 1}")
    if world == 1:
        return model
    for layer in model.model.layers:
        for name, (dim, start, end) in _layer_cuts(layer, rank, world).items():
            linear = layer.get_submodule(name)
            if dim == 0:
                _shard_rows(linear, start, end)
            else:
                _shard_cols(linear, start, end, rank)
        attn = layer.self_attn
        attn.n_heads, attn.n_kv = attn.n_heads // world, attn.n_kv // world
    return model
