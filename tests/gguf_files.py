"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes a Llama: its tensor names, the
Q/K rows permuted, a byte-level BPE ("gpt2") tokenizer with merges, the special ids and a chat template."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from tforce.model.synthetic import byte_tokenizer, make_checkpoint

TINY = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
MERGES = ["t h", "th e"]
UNREADABLE = ("Q8_1",)  # GGUF types (names) gguf's Python package neither quantizes nor dequantizes
# The byte vocabulary (<unk>, <s>, </s>, 256 bytes), the merges' tokens, then an end-of-turn token.
_BYTES = byte_tokenizer().get_vocab()
TOKENS = sorted(_BYTES, key=_BYTES.get) + ["th", "the", "<|eot|>"]
EOT = len(TOKENS) - 1
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}<|eot|>{% endfor %}"
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Q and K (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4k(w: np.ndarray) -> np.ndarray:
    """w (N, K), K a multiple of 256 -> Q4_K bytes (N, K / 256 * 144) in llama.cpp's layout, by a plain
    min/max quantizer (the gguf package has no Q4_K quantizer): per super-block d, dmin (float16), the
    eight sub-blocks' 6-bit scales and minimums packed in 12 bytes, then the codes, sub-block 2j in the
    low nibbles of bytes 32j..32j+31 and 2j+1 in their high nibbles."""
    sub = w.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    step, mins = (sub.max(-1) - low) / 15, -low
    d, dmin = (step.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d.astype(np.float32), 1e-8)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(mins / np.maximum(dmin.astype(np.float32), 1e-8)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((sub + offset[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 0x0F) | (mn[:, 4:] & 0x0F) << 4], axis=1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)
    head = np.stack([d, dmin], 1).view(np.uint8)
    return np.concatenate([head, packed, qs], axis=1).reshape(w.shape[0], -1)


def write_llama(path: Path, seed: int = 0, dtype=np.float32, qtype=None, embedding=None, **shape) -> Path:
    """A random tiny Llama (tforce.model.synthetic's weights, seed `seed`, TINY's shape with `shape`'s
    changes) as the GGUF file `path`; qtype (a gguf.GGMLQuantizationType) quantizes the layers'
    projections as llama.cpp's quantize does, embedding the token table, by gguf's own quantizer."""
    import gguf

    TINY_ = {**TINY, **shape}
    source = make_checkpoint(path.with_suffix(".src"), seed=seed, tokenizer=False, vocab_size=len(TOKENS), **TINY_)
    state = load_file(str(source / "model.safetensors"))
    heads, kv = TINY_["num_attention_heads"], TINY_["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(TINY_["max_position_embeddings"])
    w.add_embedding_length(TINY_["hidden_size"])
    w.add_block_count(TINY_["num_hidden_layers"])
    w.add_feed_forward_length(TINY_["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(TINY_["hidden_size"] // heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 4) + [3])  # 3: control (special), 1: normal
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(EOT)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(TINY_["num_hidden_layers"]):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in LAYER.items()})
    for hf, name in names.items():
        t = state[hf]
        if name.endswith("attn_q.weight"):
            t = _permute(t, heads)
        elif name.endswith("attn_k.weight"):
            t = _permute(t, kv)
        kind = embedding if name == "token_embd.weight" else qtype if t.ndim == 2 and name.startswith("blk.") else None
        if kind is not None and kind.name in UNREADABLE:  # zero blocks of a type gguf cannot quantize (refusals only)
            block, size = gguf.GGML_QUANT_SIZES[kind]
            w.add_tensor(name, np.zeros((t.shape[0], t.shape[1] // block * size), np.uint8), raw_dtype=kind)
        elif kind is not None and kind.name == "Q4_K":
            w.add_tensor(name, quantize_q4k(t), raw_dtype=kind)
        elif kind is not None:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32), kind), raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=dtype if t.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_other(path: Path, arch: str = "gpt2") -> Path:
    """A GGUF of another architecture: its metadata alone (tforce refuses it before reading tensors)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
