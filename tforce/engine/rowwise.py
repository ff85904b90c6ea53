"""The verifier's forward computed row by row: each of the T new tokens gets exactly the arithmetic a
one-token forward at its position would get, while the cache is still filled (and an offloaded layer
still streamed from host memory) once per forward.

Why: a forward over T tokens and T forwards over one token round differently (a matrix product with 7
rows may take another kernel or reduction order than one with 1 row; attention over a masked block is
not attention over the visible prefix): ~2e-6 in float32 and ~1.5e-2 in bfloat16 on a tiny model
(tests/test_rowwise.py). A greedy token then differs from plain decoding's wherever the target's top two
logits are closer than that. With this runner on the full-cache level
(`deterministic=True`) every logit the verifier computes is bit for bit the one plain decoding computes,
so greedy TriForce equals greedy `ar` token for token in any dtype, on the same device and kernels.

Same shapes, same kernels: every linear layer, norm and MLP sees a (1, 1, hidden) input, as in a
one-token forward; row t attends to the first L + t + 1 keys of the cache's view without a mask, as a
one-token forward at that position does. Elementwise steps (RoPE, residual adds) are the same per element
whatever the batch. The cost: each weight is read T times per verification instead of once, which is
small beside streaming the KV cache from host memory at long context and large on chip (`tforce bench
--deterministic` measures it). The network's code (model/network.py) is used as it is; only the order of the
calls differs, so this file must follow model/network.py's forward.
"""
from __future__ import annotations

import torch

from ..model.attention import attend
from ..cache.base import CacheView


class RowwiseRunner:
    """runner(ids, last_n) with the contract of model(ids, cache, last_n) after cache.begin(T), for a
    cache whose views are the full prefix plus the new tokens (FullCache, OffloadedCache: view.causal)."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, last_n: int | None):
        if last_n == 0:  # prefill computes no logits: the plain forward, exactly as plain decoding prefills
            return self.model(ids, self.cache, last_n=0)
        body, T = self.model.model, ids.shape[1]
        rows = [body.embed_tokens(ids[:, t:t + 1]) for t in range(T)]  # T x (B, 1, hidden)
        for layer in body.layers:
            rows = self._layer(layer, rows)
        keep = rows if last_n is None else rows[T - last_n:]
        return torch.cat([self.model.head(x) for x in keep], dim=1)  # (B, last_n, V)

    def _layer(self, layer, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        attn = layer.self_attn
        normed = [layer.input_layernorm(x) for x in rows]
        q, k, v = (torch.cat(parts, dim=1) for parts in zip(*(attn.qkv(h) for h in normed)))
        q, view = self.cache.update(attn.layer, q, k, v)  # writes all T rows' K/V once
        assert view.causal, "row-wise verification needs a cache whose view is prefix + new tokens"
        start = view.k.shape[1] - len(rows)  # keys before the first new token
        out = []
        for t, x in enumerate(rows):
            visible = CacheView(view.k[:, :start + t + 1], view.v[:, :start + t + 1], None, causal=True)
            a = attend(q[:, t:t + 1].contiguous(), visible)  # (B, 1, H_q, D)
            x = x + attn.o_proj(a.reshape(x.shape[0], 1, -1))
            out.append(x + layer.mlp(layer.post_attention_layernorm(x)))
        return out
