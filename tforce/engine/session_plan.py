"""The memory plan of one session (placement.py's, for the models as built and the device as it is now),
and a built model's placement.Shape."""
from __future__ import annotations

import psutil
import torch

from . import placement


def model_shape(model) -> placement.Shape:
    """placement.Shape of a built model as it is (a tensor-parallel rank's shard included), its weights
    counted from its parameters and buffers (quantized projections hold theirs as buffers)."""
    layer = model.model.layers[0]
    params = {p.data_ptr(): p.nbytes for p in [*model.parameters(), *model.buffers()]}  # tied embeddings once
    p = next(model.parameters())
    return placement.Shape(len(model.model.layers), model.config.hidden_size, layer.mlp.gate_proj.out_features,
                           layer.self_attn.n_heads, model.n_kv_heads, model.head_dim, model.config.vocab_size,
                           p.element_size(), sum(params.values()))


def plan_session(target, draft, work: placement.Work, offload: str, gpu_memory: int | None,
          device_free: int | None = None) -> placement.Plan:
    """The memory plan of this generation. Device budget, for everything including the CUDA context: on
    CUDA, the device's memory (what is allocated now, the context, what is free), capped by gpu_memory;
    with device_free, what is loaded now plus device_free (a CPU run then plans as if a device had that
    room beside the weights); a CPU run without it: no device, everything in place."""
    shape = model_shape(target)
    small = model_shape(draft) if draft is not None and work.spec.uses_draft else None
    loaded = shape.weights + (small.weights if small else 0)
    host_free = psutil.virtual_memory().available
    dev = next(target.parameters()).device
    context, budget = 0, None
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        reserved = torch.cuda.memory_reserved(dev)
        context = total - free - reserved  # the CUDA context and other processes' memory
        room = device_free if device_free is not None else free + reserved - torch.cuda.memory_allocated(dev)
        budget = loaded + context + room
    elif device_free is not None:
        budget = loaded + device_free
    if budget is not None and gpu_memory is not None:
        budget = min(budget, gpu_memory)
    return placement.plan(shape, work, offload, budget, host_free, small, context)
