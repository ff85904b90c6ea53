"""A GGUF file's tensors as tforce's state dict, the layers' projections kept quantized (docs/architecture.md,
"Weights"): the conversion cache then holds about the file's bytes, not a float32 copy of them.

Per projection (q, k, v, o, gate, up, down), by the file's type:
- Q4_0, Q4_1: int4 groups of 32 mapped block for block: the 4-bit codes as the file has them, the block's
  scale d and minimum m become the kernel's scale d and zero m + 8 d (Q4_0: zero 0), stored in float32
  and rounded to bfloat16 (the kernel's dtype) at load: the only change to the file's values; dequantized
  (--weights float, or off the CPU) they are the file's values.
- Q4_K (super-blocks of 256: eight sub-blocks of 32, each with a 6-bit scale and a 6-bit minimum times the
  super-block's float16 d and dmin): mapped the same way, each sub-block one int4 group of scale d sc and
  zero 8 d sc - dmin m.
- other types of 4 bits or fewer (Q3_K, Q2_K, IQ*): dequantized by the gguf package, re-quantized to int4
  (groups of 32, quant.int4_weights).
- Q5_*, Q6_K, Q8_*: dequantized, re-quantized to int8 per output channel (the kernel has no 5-8-bit group
  form).
- F32, F16, BF16 (and any shape a kernel refuses): kept as floating point.
Every other tensor (embeddings, norms, biases, the output head) is float32 in the model: a Q8_0 one (SmolLM2's
embedding table) is stored in the cache as its int8 codes and float16 block scales and dequantized exactly at
load, any other type dequantized now.

llama.cpp stores a Llama's (and Mistral's) Q and K rows in its own rotary order; they are put back in
Hugging Face's order here, codes and scales alike (the same permutation as transformers' GGUF loader).
"""
from __future__ import annotations

import numpy as np
import torch

from .quant import GROUP, PROJECTIONS, int4_weights, int8_weights, pack_int4, shape_problem

# GGUF tensor names of a block -> the Hugging Face module names (llama.cpp's gguf-py tensor map, Llama/Qwen).
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PERMUTED = ("llama", "mistral")  # the architectures whose Q/K rows llama.cpp reorders


def hf_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for a name tforce has no use
    for (rope_freqs: the config carries the scaling)."""
    base, _, kind = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
    return None


def scheme_for(qtype) -> tuple[str | None, str]:
    """(int4, int8 or None for floating point, how) of a projection stored as GGUF type qtype."""
    from gguf import GGMLQuantizationType as Q

    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        return "int4", "mapped"
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return None, "kept"
    bits = {Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 6, Q.Q8_0: 8, Q.Q8_1: 8, Q.Q8_K: 8}.get(qtype, 4)
    return ("int4" if bits <= 4 else "int8"), "re-quantized"


def q4_blocks(raw: np.ndarray, qtype, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K bytes (N, K / 32 * block) -> (codes uint8 (N, K) in 0..15, scales_and_zeros float32
    (K / 32, N, 2): the file's values; QuantLinear rounds them to bfloat16 for the kernel). A block: d
    (float16), for Q4_1 m (float16), then 16 bytes whose low nibbles are the block's first 16 codes and high
    nibbles its last 16; its values are d (q - 8) (Q4_0), d q + m (Q4_1)."""
    from gguf import GGMLQuantizationType as Q

    if qtype == Q.Q4_K:
        return _q4k_blocks(raw, N, K)
    head = 2 if qtype == Q.Q4_0 else 4
    blocks = np.ascontiguousarray(raw).reshape(N, K // GROUP, head + 16)
    d = _f16(blocks, 0).astype(np.float32)
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(N, K)
    if qtype == Q.Q4_0:
        zero = np.zeros_like(d)
    else:
        zero = _f16(blocks, 2).astype(np.float32) + 8 * d
    sz = torch.from_numpy(np.stack([d, zero], -1)).transpose(0, 1).contiguous()
    return torch.from_numpy(codes.astype(np.uint8)), sz


def _q4k_blocks(raw: np.ndarray, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_blocks for Q4_K: a super-block is d, dmin (float16), 12 bytes of packed 6-bit scales sc and minimums
    m (unpacked by the gguf package), then 128 bytes: each 32 of them hold sub-block 2j's codes in their
    low nibbles and 2j+1's in their high; sub-block j's values are d sc_j q - dmin m_j."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(raw).reshape(N * K // 256, 144)
    d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = d[:, None] * sc.astype(np.float32)  # (super-blocks, 8): exact in float32 (11 by 6 bits)
    zero = 8 * scale - dmin[:, None] * m.astype(np.float32)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(N, K)
    sz = torch.from_numpy(np.stack([scale, zero], -1).reshape(N, K // GROUP, 2)).transpose(0, 1).contiguous()
    return torch.from_numpy(codes.astype(np.uint8)), sz


def q8_blocks(raw: np.ndarray, name: str, N: int, K: int) -> dict:
    """Q8_0 bytes (N, K / 32 * 34) -> {name.q8: int8 (N, K), name.q8_scales: float16 (N, K / 32)}: blocks of
    32 values d q, d (float16) first; dequantized exactly at load (quant_stored.expand_q8)."""
    blocks = np.ascontiguousarray(raw).reshape(N, K // GROUP, 34)
    d = _f16(blocks, 0)
    q = blocks[..., 2:].copy().view(np.int8).reshape(N, K)
    return {f"{name}.q8": torch.from_numpy(q), f"{name}.q8_scales": torch.from_numpy(d)}


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 each block (the last axis, bytes) holds at byte `at`."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0]


def _rows(N: int, heads: int) -> np.ndarray:
    """The index that puts llama.cpp's Q/K rows back in Hugging Face's order (transformers'
    reverse_permute_weights applied to the row numbers)."""
    return np.arange(N).reshape(heads, N // heads // 2, 2).swapaxes(2, 1).reshape(N)


def read_state(file, arch: str, heads: int, kv_heads: int) -> tuple[dict, dict]:
    """(state dict, {module: {"scheme", "source", "how"}} of the quantized projections) of GGUF `file`.
    A quantized projection `m` is stored as m.qweight (int8 (N, K), or int4 codes two to a byte, uint8
    (N, K / 2): quant.pack_int4) and m.scales (the kernel's layout: float32 for mapped Q4 blocks, the file's
    values; bfloat16 where re-quantized)."""
    from gguf import GGUFReader, quants
    from gguf import GGMLQuantizationType as Q

    state, quantized = {}, {}
    for t in GGUFReader(str(file)).tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
        module, _, kind = name.rpartition(".")
        perm = None
        if arch in _PERMUTED and kind in ("weight", "bias") and module.endswith(("q_proj", "k_proj")):
            perm = _rows(shape[0], heads if module.endswith("q_proj") else kv_heads)
        scheme, how = scheme_for(t.tensor_type)
        projection = kind == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS and len(shape) == 2
        # the CPU's shape rules, which imply CUDA's: one conversion serves either device
        if projection and scheme and shape_problem(scheme, shape[1], shape[0]):
            scheme, how = None, "kept"  # a shape the kernel refuses stays floating point
        if projection and scheme == "int4" and how == "mapped":
            codes, sz = q4_blocks(t.data, t.tensor_type, *shape)
            if perm is not None:
                codes, sz = codes[perm], sz[:, perm]
            state[f"{module}.qweight"], state[f"{module}.scales"] = pack_int4(codes), sz
        elif not projection and t.tensor_type == Q.Q8_0 and perm is None:
            state.update(q8_blocks(t.data, name, *shape))  # the cache keeps its bytes (quant_stored)
            continue
        else:
            if t.tensor_type in (Q.F32, Q.F16):
                w = np.asarray(t.data, dtype=np.float32)
            else:
                w = quants.dequantize(t.data, t.tensor_type)  # a type it cannot: refused by gguf_convert.check_file
            w = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(shape)  # a copy: the file is read-only
            if perm is not None:
                w = w[perm]
            if not (projection and scheme):
                state[name] = w.contiguous()
                continue
            if scheme == "int4":
                codes, sz = int4_weights(w)
                state[f"{module}.qweight"], state[f"{module}.scales"] = pack_int4(codes), sz
            else:
                state[f"{module}.qweight"], state[f"{module}.scales"] = int8_weights(w)
        quantized[module] = {"scheme": scheme, "source": t.tensor_type.name, "how": how}
    return state, quantized
