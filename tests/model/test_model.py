"""Our Llama (through a FullCache) against transformers' LlamaForCausalLM on the same weights."""
from __future__ import annotations

import pytest
import torch

import tforce
from model_helpers import feed, forward, full_cache, hf_logits, hf_model, random_ids
from tforce.cache import FullCache
from tforce.cache.rope import Rotary
from tforce.model.synthetic import make_checkpoint

ARCHS = ["mha", "gqa", "yarn", "llama3"]
T = 37  # not a power of two, not a multiple of the chunk sizes below


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return {name: hf_model(tiny_dir / name) for name in ARCHS}


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(tiny, hf, name):
    model = tiny[name].model
    ids = random_ids(T, seed=1)
    ours = forward(model, full_cache(model), ids)
    ref = hf_logits(hf[name], ids)
    assert ours.shape == ref.shape == (1, T, model.config.vocab_size)
    assert ref.std() > 0.5  # the logits are not flat: a wrong position or head would show
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("chunks", [[20] + [1] * 17, [1] * 37, [3] * 12 + [1], [20, 3, 3, 3, 3, 3, 2]],
                         ids=["prefill+ones", "ones", "threes", "prefill+threes"])
def test_incremental_equals_full_forward(tiny, name, chunks):
    model = tiny[name].model
    ids = random_ids(T, seed=2)
    whole = forward(model, full_cache(model), ids)
    pieces = feed(model, full_cache(model), ids, chunks)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mha", "gqa", "llama3"])
def test_greedy_ar_equals_transformers_generate(tiny, hf, name):
    prompt = random_ids(11, seed=3)
    n_new = 24
    ref_model = hf[name]
    ref_model.generation_config.eos_token_id = None  # ignore EOS, as ignore_eos=True does for ours
    with torch.no_grad():
        ref = ref_model.generate(prompt, do_sample=False, max_new_tokens=n_new)[0, prompt.shape[1]:].tolist()
    ours = tforce.generate(tiny[name], prompt[0].tolist(), method="ar", temperature=0, ignore_eos=True,
                           max_new_tokens=n_new).tokens
    assert len(ref) == n_new
    assert ours == ref


@pytest.mark.parametrize("scaling", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}],
                         ids=["dynamic", "linear"])
def test_scaled_rope_matches_transformers(tmp_path, scaling):
    """Prompt and generation stay under max_position_embeddings, where transformers' dynamic NTK keeps the
    base frequencies (and ours, fixed once per generation, must agree); linear scaling divides positions."""
    path = make_checkpoint(tmp_path / scaling["rope_type"], seed=7, num_key_value_heads=2,
                           max_position_embeddings=64, rope_scaling=scaling)
    loaded = tforce.load_model(str(path))
    ref_model = hf_model(path)
    ids = random_ids(40, seed=4)
    ours = forward(loaded.model, full_cache(loaded.model, capacity=64), ids)
    torch.testing.assert_close(ours, hf_logits(ref_model, ids), atol=1e-4, rtol=1e-4)

    ref_model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = ref_model.generate(ids, do_sample=False, max_new_tokens=16)[0, 40:].tolist()
    out = tforce.generate(loaded, ids[0].tolist(), method="ar", temperature=0, ignore_eos=True, max_new_tokens=16)
    assert out.tokens == ref


def test_scaled_rope_changes_the_logits(tmp_path, tiny):
    """Guard for the test above: linear scaling must actually change the model's output."""
    path = make_checkpoint(tmp_path / "linear", seed=1, num_key_value_heads=2,  # gqa's seed and shape
                           rope_scaling={"rope_type": "linear", "factor": 2.0})
    scaled = tforce.load_model(str(path)).model
    plain = tiny["gqa"].model
    ids = random_ids(T, seed=5)
    a, b = forward(scaled, full_cache(scaled), ids), forward(plain, full_cache(plain), ids)
    assert torch.equal(a[:, 0], b[:, 0])  # position 0 is not rotated: same weights, same logits
    assert (a - b).abs().max() > 1e-2


def _logits_and_hidden(model, ids):
    """The forward's logits and the final-norm output they were computed from."""
    seen = []
    hook = model.model.norm.register_forward_hook(lambda m, i, out: seen.append(out))
    try:
        cfg, p = model.config, next(model.parameters())
        cache = FullCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, 64,
                          Rotary(cfg, device=p.device), dtype=p.dtype, device=p.device)
        logits = forward(model, cache, ids)
    finally:
        hook.remove()
    return logits, seen[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_logits_are_float32_products_not_rounded_to_bf16(tiny_dir, device):
    """With bfloat16 weights the logits are the float32-accumulated product of the bfloat16 hidden state
    and lm_head, kept in float32: rounding them to bfloat16 (8 mantissa bits) would make argmax ties."""
    model = tforce.load_model(str(tiny_dir / "gqa"), device=device, dtype=torch.bfloat16).model
    logits, hidden = _logits_and_hidden(model, random_ids(T, seed=3).to(device))
    exact = hidden.double() @ model.lm_head.weight.double().T  # (B, T, V)
    assert logits.dtype == torch.float32
    assert (exact.float().bfloat16().double() != exact).float().mean() > 0.9  # bf16 rounding is visible
    torch.testing.assert_close(logits.double(), exact, atol=1e-5, rtol=1e-5)
