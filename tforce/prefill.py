"""Layer-major prefill: every layer runs over the whole prompt before the next one starts.

Token-major chunked prefill re-reads the KV prefix of every layer for every chunk; with the KV cache in
host memory that is PCIe traffic quadratic in the prompt. Layer-major order keeps one layer's K/V for
the whole prompt on the device in a scratch FullCache, runs that layer chunk by chunk, then hands the
layer to the real cache, which sends an offloaded layer to host memory exactly once: traffic linear
in the prompt. The chunks are the same as token-major prefill's, so the results are bit-identical.
Device memory: the prompt's hidden states plus one layer's K/V, which an offloaded cache's first
staging buffer holds (it is idle until the first forward after prefill), so only the hidden states
are new (placement.py counts them as "prefill hidden states").
"""
from __future__ import annotations

import torch

from .cache import FullCache


class _AsLayerZero:
    """Lets a decoder layer with any index write into the one-layer scratch cache."""

    def __init__(self, scratch: FullCache):
        self.scratch = scratch

    def update(self, layer, q, k, v):
        return self.scratch.update(0, q, k, v)


def _scratch(model, full: FullCache, n: int) -> tuple[FullCache, int]:
    """A one-layer FullCache for n tokens, and the device bytes it allocated: its storage is the first
    staging buffer of an offloaded cache (nothing new), else its own."""
    stage_k = getattr(full, "stage_k", None)
    if stage_k is None:
        scratch = FullCache(1, model.n_kv_heads, model.head_dim, n, full.rotary, full.k.dtype, full.k.device)
        return scratch, scratch.k.nbytes + scratch.v.nbytes
    scratch = FullCache(1, model.n_kv_heads, model.head_dim, 0, full.rotary, full.k.dtype, stage_k.device)
    scratch.k, scratch.v = stage_k[:1, :, :n], full.stage_v[:1, :, :n]  # (1, 1, n, H_kv, D) views
    scratch.capacity = n
    return scratch, 0


@torch.inference_mode()
def prefill_layer_major(model, ids: torch.Tensor, full: FullCache, chunk: int, progress=None,
                        on_layer=None) -> int:
    """Append ids (N,) to `full` (which must be empty); progress(done, total) in token-layers;
    on_layer(i, keys) sees each layer's rotated keys (1, N, H_kv, D) on the device before they leave.
    Returns the device bytes it allocated beyond the model's own activations (hidden states, scratch)."""
    assert full.length == 0, "layer-major prefill starts from an empty cache"
    n, layers = len(ids), model.model.layers
    scratch, scratch_bytes = _scratch(model, full, n)
    x = model.model.embed_tokens(ids[None].to(scratch.k.device))  # (1, N, hidden)
    alias = _AsLayerZero(scratch)
    for i, layer in enumerate(layers):
        scratch.truncate(0)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            scratch.begin(b - a)
            x[:, a:b] = layer(x[:, a:b], alias)
            scratch.commit(b - a)
            if progress:
                progress(i * n + b, len(layers) * n)
        if on_layer:
            on_layer(i, scratch.k[0, :, :n])
        full.write_layer(i, scratch.k[0, :, :n], scratch.v[0, :, :n])
        full.queries[i] = scratch.queries[0]
    full.query_pos = scratch.query_pos
    full.commit_written(n)
    return x.nbytes + scratch_bytes
