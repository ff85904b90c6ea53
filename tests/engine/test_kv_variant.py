"""scripts/cpu_kv_bench.py's MHA variant (every KV head repeated per query group) computes the original
GQA model's function: the same logits, in transformers' LlamaForCausalLM and in tforce's model, and so
the same greedy tokens, with `group` times the KV cache. Heads repeated in the wrong order (tiled:
h0 h1 h0 h1 instead of h0 h0 h1 h1) give another function, which these checks tell apart."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tforce
from model_helpers import forward, full_cache, hf_logits, hf_model, random_ids

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cpu_kv_bench.py"


def _script():
    spec = importlib.util.spec_from_file_location("cpu_kv_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cpu_kv_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def _ours(path) -> torch.Tensor:
    model = tforce.load_model(str(path), tokenizer=False).model
    ids = random_ids(40, seed=7)
    return forward(model, full_cache(model, 64), ids)


def _tiled(variant: Path, dst: Path, n_kv: int, group: int, head_dim: int) -> Path:
    """The variant with its heads reordered as a tiled repeat would have put them."""
    dst.mkdir()
    state = load_file(str(variant / "model.safetensors"))
    order = torch.arange(n_kv * group).view(n_kv, group).T.flatten()  # tiled slot i holds head order[i]
    for name, t in state.items():
        if ".k_proj." in name or ".v_proj." in name:
            state[name] = t.view(n_kv * group, head_dim, -1)[order].reshape(t.shape).contiguous()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((variant / "config.json").read_text())
    return dst


def test_mha_variant_computes_the_same_function(tiny_dir, tmp_path):
    mod = _script()
    src = tiny_dir / "gqa"  # 4 query heads, 2 KV heads
    variant = mod.write_mha_variant(src, tmp_path / "mha")
    config = json.loads((variant / "config.json").read_text())
    assert config["num_key_value_heads"] == config["num_attention_heads"] == 4
    original, mha = tforce.load_model(str(src)), tforce.load_model(str(variant))
    assert mha.model.n_kv_heads == 2 * original.model.n_kv_heads  # twice the KV cache per token
    layers, head_dim = config["num_hidden_layers"], original.model.head_dim
    assert mod.kv_token_bytes(original.model) == 2 * layers * 2 * head_dim * 4  # K and V, 2 KV heads, float32
    assert mod.kv_token_bytes(mha.model) == 2 * mod.kv_token_bytes(original.model)
    embedding = original.model.model.embed_tokens.weight.nbytes
    assert mod.weight_bytes(original.model) == sum(p.nbytes for p in original.model.parameters()) - embedding

    want = _ours(src)
    torch.testing.assert_close(_ours(variant), want, atol=1e-5, rtol=1e-5)
    ids = random_ids(40, seed=7)
    torch.testing.assert_close(hf_logits(hf_model(variant), ids), hf_logits(hf_model(src), ids), atol=1e-5, rtol=1e-5)

    prompt = random_ids(50, seed=2)[0].tolist()
    greedy = [tforce.generate(m, prompt, method="ar", max_new_tokens=24, temperature=0, ignore_eos=True).tokens
              for m in (original, mha)]
    assert greedy[0] == greedy[1]

    wrong = _tiled(variant, tmp_path / "tiled", n_kv=2, group=2, head_dim=original.model.head_dim)
    assert (_ours(wrong) - want).abs().max() > 1e-2  # the check above would catch heads in the wrong order
