"""Random-weight Llama checkpoints of real or tiny architectures, and tiny ones of the other families
(Mistral, Qwen2, Qwen3), saved the Hugging Face way.

Used by the tests (tiny MHA/GQA/YaRN/llama3 models, one of each family), by `scripts/make_tiny.py` for the demo until a
trained pair exists, and by `tforce bench --synthetic`. Anything made here is random weights and is
labelled so (config.json carries "tforce_synthetic": true).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ARCHITECTURES = {
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, vocab_size=259),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, max_position_embeddings=131072, vocab_size=32000,
                      rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, max_position_embeddings=131072, vocab_size=32000,
                       rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}),
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, max_position_embeddings=131072, vocab_size=128256,
                        rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with 259 ids (<unk>, <s>, </s>, then the 256 bytes): no training, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_config(arch: str = "tiny", **overrides) -> LlamaConfig:
    params = dict(ARCHITECTURES[arch], bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    params.update(overrides)
    cfg = LlamaConfig(**params)
    cfg.tforce_synthetic = True
    return cfg


def make_checkpoint(path: str | Path, arch: str = "tiny", seed: int = 0, dtype=torch.float32,
                    tokenizer: bool = True, **overrides) -> Path:
    """Write a random LlamaForCausalLM (config.json + model.safetensors [+ byte tokenizer]) to path."""
    path = Path(path)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_config(arch, **overrides)).to(dtype)
    _sharpen(model)
    model.save_pretrained(path)
    if tokenizer:
        byte_tokenizer().save_pretrained(path)
    return path


def _sharpen(model) -> None:
    """The default init (std 0.02) gives near-uniform outputs: matrices get N(0, 1/fan_in) instead."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)


# Each family's keys in config.json beside the shapes, as its releases ship them (Mistral-7B-v0.2 on,
# Qwen2.5, Qwen3): rope_theta and rope_scaling at the top level, not transformers 5's rope_parameters.
FAMILY_KEYS = {
    "mistral": dict(rope_theta=1000000.0, sliding_window=None, rope_scaling=None),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False, sliding_window=131072,
                  max_window_layers=21, rope_scaling=None),
    "qwen3": dict(rope_theta=1000000.0, head_dim=32, attention_bias=False, use_sliding_window=False,
                  sliding_window=None, max_window_layers=28, rope_scaling=None),
}


def make_family_checkpoint(path: str | Path, family: str, seed: int = 0, max_shard_size: str | None = None,
                           **overrides) -> Path:
    """Write a random checkpoint of transformers' own class for `family` (MistralForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM) with the tiny shapes and the byte tokenizer, its config.json in
    the family's released layout (FAMILY_KEYS, then overrides). Biases are random and Qwen3's q/k norm
    weights are not ones (transformers initialises them to 0 and 1). max_shard_size: sharded safetensors
    with model.safetensors.index.json, as large checkpoints come."""
    from transformers import AutoConfig

    from .families import hf_class

    path = Path(path)
    keys = dict(ARCHITECTURES["tiny"], bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    keys.update(FAMILY_KEYS[family], **overrides)
    config = AutoConfig.for_model(family, **copy.deepcopy(keys))  # it writes into a rope_scaling it is given
    torch.manual_seed(seed)
    model = hf_class(config)(config)
    _sharpen(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 2.0)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    written = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):  # transformers 5 writes these; releases have neither
        written.pop(key, None)
    written.update(FAMILY_KEYS[family], **overrides)
    written["tforce_synthetic"] = True
    (path / "config.json").write_text(json.dumps(written, indent=2))
    byte_tokenizer().save_pretrained(path)
    return path
