"""The Llama-family decoder (Llama 2, Llama 3/3.1, Mistral, Qwen2/Qwen2.5, Qwen3): the network only.

Parameter names mirror transformers' *ForCausalLM of each family so a Hugging Face state dict loads as it
is. The families differ only in what each layer holds (biases, Qwen3's q_norm/k_norm, an explicit head
size), decided from the config when the model is built (families.py), never while it runs.
The model knows nothing of positions, cache layout, sampling, tensor parallelism or CUDA graphs: each
attention layer hands its fresh q, k, v to the cache, which applies its own position rule (RoPE) and
returns the keys and values to attend to (see docs/architecture.md).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .attention import attend
from .families import head_dim, kv_heads, layout
from .linear import Linear, linear


class Attention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.n_kv = kv_heads(config)
        self.head_dim = head_dim(config)
        parts = layout(config)
        h, d = config.hidden_size, self.head_dim
        self.q_proj = Linear(h, self.n_heads * d, bias=parts.qkv_bias)
        self.k_proj = Linear(h, self.n_kv * d, bias=parts.qkv_bias)
        self.v_proj = Linear(h, self.n_kv * d, bias=parts.qkv_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=parts.o_bias)
        if parts.qk_norm:  # one norm over head_dim shared by every head: whole on every tensor-parallel rank
            self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, hidden) -> q (B, T, H_q, D), k and v (B, T, H_kv, D), before RoPE (the cache applies it)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.head_dim))
        return q, k, self.v_proj(x).view(B, T, -1, self.head_dim)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        B, T, _ = x.shape
        q, view = cache.update(self.layer, *self.qkv(x))
        out = attend(q, view)  # (B, T, H_q, D)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU, named as transformers' LlamaMLP (gate_proj, up_proj, down_proj), biased as the family's
    layout says (LlamaMLP reads config.mlp_bias, which the other families' configs lack)."""

    def __init__(self, config, bias: bool):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config, layout(config).mlp_bias)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Llama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def n_kv_heads(self) -> int:
        """KV heads this process holds: all of them, or its shard under tensor parallelism."""
        attn = self.model.layers[0].self_attn
        return attn.k_proj.out_features // attn.head_dim

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, last_n: int | None = None) -> torch.Tensor | None:
        """ids (B, T) -> logits (B, last_n or T, V) in float32; last_n=0 runs the layers only (prefill).

        The cache must have been told `begin(T)` for this forward; the caller commits afterwards.
        """
        x = self.hidden(ids, cache)
        if last_n == 0:
            return None
        if last_n is not None:
            x = x[:, -last_n:]
        return self.head(x)

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """ids (B, T) -> the last layer's hidden states (B, T, hidden), before the final norm: forward's
        first half, for a caller that picks each row's own last position (a ragged prefill's next token)."""
        x = self.model.embed_tokens(ids)  # (B, T, hidden)
        for layer in self.model.layers:
            x = layer(x, cache)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, hidden) -> logits (B, T, V) in float32."""
        return float32_logits(self.model.norm(x), self.lm_head.weight)


# torch >= 2.8 has mm(a, b, out_dtype=float32) for float16/bfloat16 inputs, on CUDA only.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def float32_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h (B, T, hidden) @ weight (V, hidden)^T -> (B, T, V) float32, accumulated in float32 and never
    rounded to the weights' dtype (a bfloat16 output would make argmax ties frequent).

    CUDA, 16-bit weights: one GEMM with a float32 output (cuBLAS accumulates in float32 anyway).
    CPU without that kernel, 16-bit weights: the weight is converted to float32 at every call (4 bytes
    per parameter written and read again: 2 GB for Llama-3's 128K x 4096 lm_head; CPU runs are for tests
    and demos). float32 weights: the plain product (by `linear`, as every projection).
    """
    if weight.dtype == torch.float32:
        return linear(h.float(), weight)
    if h.is_cuda and _MM_OUT_DTYPE:
        rows = h.reshape(-1, h.shape[-1])
        return torch.mm(rows, weight.t(), out_dtype=torch.float32).view(*h.shape[:-1], -1)
    return linear(h.float(), weight.float())
