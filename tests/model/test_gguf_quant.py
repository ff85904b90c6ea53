"""A GGUF's projections kept quantized: Q4_0/Q4_1/Q4_K blocks mapped to int4 groups code for code, other types
re-quantized, Q8_0 tables stored as their bytes and dequantized exactly; the model as loaded matches
transformers' float32 dequantization of the same file within the kernels' bfloat16 rounding, every
method's greedy tokens equal `ar`'s on it, and a cache entry of the old float32 layout is replaced."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import tforce
import tforce.model.gguf as tg
from cli_helpers import one_error_line
from gguf_files import write_llama
from tforce.cli import app
from tforce.model.gguf_tensors import q4_blocks, q8_blocks
from tforce.model.quant import QuantLinear, dequantize_stored
from tforce.model.quant_stored import expand_q8
from tforce.model.registry import resolve

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
SHAPE = dict(intermediate_size=128)  # every projection's inputs a multiple of 32: blocks of both formats
K_SHAPE = dict(hidden_size=256, intermediate_size=256)  # a multiple of Q4_K's super-block


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_keep_every_code_and_round_only_the_scales(qtype):
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))  # the file's values, float32
    codes, sz = q4_blocks(raw, qtype, 48, 96)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    # stored: the file's values (float32 scales), as --weights float and a GPU dequantize them
    assert torch.allclose(dequantize_stored("int4", packed, sz), ref, rtol=0, atol=1e-6)
    layer = QuantLinear.stored("int4", packed, sz)
    assert torch.equal(layer.codes(), codes.to(torch.int32))  # the kernel holds the file's codes
    bf = sz.to(torch.bfloat16).float()
    scale = bf[..., 0].t().repeat_interleave(32, 1)  # (N, K): each column's block scale, bfloat16
    zero = bf[..., 1].t().repeat_interleave(32, 1)
    assert torch.equal(layer.dequantized(), (codes.float() - 8) * scale + zero)
    # bfloat16 scales (8 significant bits) against the file's float16: within 2^-8 of each block's range
    bound = (ref.view(48, 3, 32).abs().amax(-1) * 2.0 ** -7).repeat_interleave(32, 1)
    assert ((layer.dequantized() - ref).abs() <= bound).all()


def test_q4k_blocks_of_any_bits_keep_every_code():
    """Q4_K super-blocks of random bytes (every 6-bit scale and minimum pattern, random float16 d and dmin):
    the mapped codes are the file's, and the stored scales and zeros give gguf's own dequantization."""
    rng = np.random.default_rng(4)
    N, K = 16, 512  # the kernel's packing takes rows in multiples of 16
    raw = rng.integers(0, 256, (N * K // 256, 144), dtype=np.uint8)
    raw[:, :4] = rng.uniform(0.01, 0.1, (N * K // 256, 2)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(N, -1)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_K))
    codes, sz = q4_blocks(raw, Q.Q4_K, N, K)
    assert sz.shape == (K // 32, N, 2) and int(codes.max()) == 15 and int(codes.min()) == 0
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    # float32 scales and zeros: the zero 8 d sc - dmin m rounds once, a few units of the last place
    assert torch.allclose(dequantize_stored("int4", packed, sz), ref, rtol=0, atol=2e-6 * float(ref.abs().max()))
    assert torch.equal(QuantLinear.stored("int4", packed, sz).codes(), codes.to(torch.int32))


def test_q8_blocks_dequantize_exactly():
    w = np.random.default_rng(1).standard_normal((10, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q8_0)
    state = q8_blocks(raw, "t", 10, 64)
    assert state["t.q8"].dtype == torch.int8 and state["t.q8_scales"].dtype == torch.float16
    expand_q8(state, torch.float32)
    assert torch.equal(state["t"], torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_quant")
    out = {}
    for name, qtype in (("q4_1", Q.Q4_1), ("q4_0", Q.Q4_0), ("q8_0", Q.Q8_0), ("q5_0", Q.Q5_0), ("q4_k", Q.Q4_K)):
        (root / name).mkdir()
        shape = K_SHAPE if name == "q4_k" else SHAPE
        out[name] = write_llama(root / name / "tiny.gguf", seed=2, qtype=qtype, embedding=Q.Q8_0, **shape)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFORCE_CACHE", str(root / "cache"))
        yield out


def _transformers_logits(file, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    return model(torch.tensor([ids])).logits[0]


def _logits(loaded, ids):
    from tforce.cache import FullCache
    from tforce.cache.rope import Rotary

    m = loaded.model
    cache = FullCache(m.config.num_hidden_layers, m.n_kv_heads, m.head_dim, 64, Rotary(m.config, 64))
    cache.begin(len(ids))
    return m(torch.tensor([ids]), cache)[0]


@pytest.mark.parametrize("name,scheme,how", [("q4_1", "int4", "mapped"), ("q4_0", "int4", "mapped"),
                                             ("q4_k", "int4", "mapped"),
                                             ("q8_0", "int8", "re-quantized"), ("q5_0", "int8", "re-quantized")])
def test_projections_stay_quantized_and_match_transformers(files, name, scheme, how):
    loaded = tforce.load_model(str(files[name]))
    assert loaded.model.weights == scheme
    layer = loaded.model.model.layers[1]
    for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.down_proj):
        assert isinstance(p, QuantLinear) and p.scheme == scheme
    listed = json.loads((resolve(str(files[name])) / "quantization.json").read_text())
    assert len(listed) == 2 * 7 and {v["how"] for v in listed.values()} == {how}
    ids = list(range(5, 45))
    got, ref = _logits(loaded, ids), _transformers_logits(files[name], ids)
    # the same model up to bfloat16 activations (and int8's re-quantization); a Q/K row order left as
    # llama.cpp's, or a misplaced block, moves logits by their own size
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("method", ["triforce", "retrieval", "naive", "streaming"])
def test_greedy_equals_ar_on_the_quantized_gguf(files, method):
    loaded = tforce.load_model(str(files["q4_1"]))
    prompt = list(range(5, 85))
    kw = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True, budget=32, chunk_size=4)
    draft = loaded if method != "retrieval" else None  # the model as its own draft
    ar = tforce.generate(loaded, prompt, method="ar", **kw).tokens
    assert tforce.generate(loaded, prompt, method=method, draft=draft, **kw).tokens == ar


@pytest.mark.parametrize("name,weights", [("q4_1", "int8"), ("q8_0", "int4"), ("q4_1", "float")])
def test_weights_option_requantizes_or_dequantizes(files, name, weights):
    """--weights re-quantizes the stored values (or dequantizes them: float), and the model runs close to the
    file's own (transformers' dequantization)."""
    loaded = tforce.load_model(str(files[name]), weights=weights)
    p = loaded.model.model.layers[0].mlp.up_proj
    if weights == "float":
        assert loaded.model.weights == "auto" and not isinstance(p, QuantLinear) and p.weight.dtype == torch.float32
    else:
        assert loaded.model.weights == weights and isinstance(p, QuantLinear) and p.scheme == weights
    ids = list(range(5, 45))
    got, ref = _logits(loaded, ids), _transformers_logits(files[name], ids)
    if weights == "float":
        assert (got - ref).abs().max() < 1e-4 * ref.abs().max()  # the file's values, float32 rounding apart
    else:  # the same as quantizing the float32 model: re-quantized from the file's values
        from tforce.model.quant import quantize

        plain = tforce.load_model(str(files[name]), weights="float")
        quantize(plain.model, weights)
        assert torch.equal(got, _logits(plain, ids))


def test_an_old_float32_entry_is_converted_again(files):
    folder = resolve(str(files["q4_1"]))
    marker = json.loads((folder / tg.MARKER).read_text())
    marker.pop("format")  # the first layout's marker had no format
    (folder / tg.MARKER).write_text(json.dumps(marker))
    assert not tg.complete(folder, marker["sha256"])
    assert resolve(str(files["q4_1"])) == folder
    assert json.loads((folder / tg.MARKER).read_text())["format"] == tg.FORMAT


def test_info_says_what_the_projections_are_stored_as(files):
    from typer.testing import CliRunner

    from tforce.cli import app

    r = CliRunner().invoke(app, ["info", "-m", str(files["q4_1"]), "--json"])
    assert r.exit_code == 0, r.output
    model = json.loads(r.stdout)["model"]
    assert model["quantized"] == {"int4 (Q4_1, mapped)": 14}
    assert model["weights_file_bytes"] == (resolve(str(files["q4_1"])) / "model.safetensors").stat().st_size
    r = CliRunner().invoke(app, ["info", "-m", str(files["q5_0"])])
    assert r.exit_code == 0 and "14 int8 (Q5_0, re-quantized)" in r.stdout, r.output


@pytest.mark.parametrize("damage", ["truncated", "unreadable type"])
def test_a_file_tforce_cannot_read_is_one_line_and_leaves_no_entry(tmp_path, monkeypatch, damage):
    """A GGUF cut short (its last tensor's bytes missing) and one whose projections are stored in a type the
    gguf package cannot dequantize (Q8_1): `tforce run` says so in one line, exits 2, and the conversion
    cache holds nothing, not even a half-written folder."""
    monkeypatch.setenv("TFORCE_CACHE", str(tmp_path / "cache"))
    if damage == "truncated":
        whole = write_llama(tmp_path / "whole.gguf", seed=3, qtype=Q.Q4_1, **SHAPE).read_bytes()
        (tmp_path / "bad.gguf").write_bytes(whole[:len(whole) - 3000])
        needle = "not a GGUF file"
    else:
        write_llama(tmp_path / "bad.gguf", seed=3, qtype=Q.Q8_1, **SHAPE)
        needle = "is stored as Q8_1, which the gguf package cannot dequantize"
    result = CliRunner().invoke(app, ["run", "-m", str(tmp_path / "bad.gguf"), "-p", "hi", "-n", "2", "--method", "ar"])
    one_error_line(result, 2, needle)
    cache = tmp_path / "cache" / "gguf"
    assert not cache.exists() or list(cache.iterdir()) == []
