"""Random-weight Llama checkpoints of real or tiny architectures, saved the Hugging Face way.

Used by the tests (tiny MHA/GQA/YaRN/llama3 models), by `scripts/make_tiny.py` for the demo until a
trained pair exists, and by `tforce bench --synthetic`. Anything made here is random weights and is
labelled so (config.json carries "tforce_synthetic": true).
"""
from __future__ import annotations

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
    cfg = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # the default init (std 0.02) gives near-uniform outputs; sharpen them
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    model.save_pretrained(path)
    if tokenizer:
        byte_tokenizer().save_pretrained(path)
    return path
