"""The model families tforce runs (config.json's model_type) and what their decoder layers add to Llama's,
read from a Hugging Face config: biases, per-head q/k norms, the head size, an effective sliding window.

Every family is Llama's layer (RMSNorm, GQA attention with RoPE, SwiGLU MLP) with these differences, as
transformers' own modeling files build them:
- llama: biases on q/k/v/o as `attention_bias` says, on the MLP as `mlp_bias` says;
- mistral: no biases whatever the config says (MistralAttention, MistralMLP);
- qwen2: biases on q/k/v always and never on o (Qwen2Attention; its config has no attention_bias);
- qwen3: biases as `attention_bias` says, and an RMSNorm over head_dim on each query and key head,
  applied before RoPE (Qwen3Attention's q_norm, k_norm).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


def _flag(config, name: str) -> bool:
    return bool(getattr(config, name, False))


FAMILIES = {
    "llama": lambda c: Layout(_flag(c, "attention_bias"), _flag(c, "attention_bias"), _flag(c, "mlp_bias"), False),
    "mistral": lambda c: Layout(False, False, False, False),
    "qwen2": lambda c: Layout(True, False, False, False),
    "qwen3": lambda c: Layout(_flag(c, "attention_bias"), _flag(c, "attention_bias"), False, True),
}


def layout(config) -> Layout:
    return FAMILIES[config.model_type](config)


def head_dim(config) -> int:
    """The size of one attention head: the config's head_dim where it names one (Qwen3's 128 with hidden
    1024 and 16 heads), else hidden size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def sliding_window(config) -> int | None:
    """The window of the layers that attend through one, or None when every layer attends to the whole
    context. Qwen configs clear sliding_window when use_sliding_window is false and list each layer's kind
    in layer_types (no layer slides below max_window_layers), which Qwen2Model and Qwen3Model follow;
    MistralModel applies its window to every layer whatever layer_types says."""
    if config.model_type in ("qwen2", "qwen3") and "sliding_attention" not in config.layer_types:
        return None
    return getattr(config, "sliding_window", None)


def hf_class(config):
    """transformers' own *ForCausalLM class for the config's family (never remote code: auto_map is not read)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
