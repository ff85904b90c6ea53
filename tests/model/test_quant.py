"""Weight-only int8 / int4 projections (tforce/model/quant.py): the products against a float reference,
every method against plain decoding of the quantized model, loading and bench's --weights.
(Sampling against the exact distribution of a quantized target: tests/engine/test_exactness.py.)"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.errors import UsageError
from tforce.model import quant
from tforce.model.quant import GROUP, PROJECTIONS, QuantLinear, kernel_block, quantize, weight_bytes
from tforce.model.synthetic import make_checkpoint

SPECULATIVE = ["triforce", "retrieval", "streaming", "naive"]
SMALL = dict(budget=16, chunk_size=4, draft_budget=12, sinks=2, gamma1=2, gamma2=4)
SHAPES = dict(hidden_size=64, intermediate_size=128)  # int4: inputs in groups of 32, outputs by 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    make_checkpoint(root / "target", seed=3, num_key_value_heads=2, **SHAPES)
    make_checkpoint(root / "draft", seed=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, num_hidden_layers=1)
    return root


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_products_equal_the_dequantized_weight(scheme, bias):
    """The kernel multiplies by exactly the weight dequantized() reports, in bfloat16 activations."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 64, bias=bias)
    q = QuantLinear(lin, scheme)
    x = torch.randn(2, 5, 96)
    ref = F.linear(x.to(torch.bfloat16).float(), q.dequantized(), lin.bias)
    got = q(x)
    assert got.shape == (2, 5, 64) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)  # the kernel's output is bfloat16
    for rows in (5, quant.DEQUANTIZE_ROWS):  # the kernel and the dequantized product: a float32 bias
        assert q(torch.randn(1, rows, 96, dtype=torch.bfloat16)).dtype == torch.bfloat16  # keeps bfloat16


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_many_rows_multiply_by_the_dequantized_weight(scheme):
    """A prefill chunk's rows (DEQUANTIZE_ROWS or more) multiply the dequantized weight in the input's dtype,
    without rounding the input to bfloat16; fewer rows take the kernel. The codes read from the kernel's
    packed layout equal the ones read through the kernel itself (SmolLM2's shapes, this CPU build)."""
    torch.manual_seed(2)
    lin = nn.Linear(576, 192, bias=True)
    q = QuantLinear(lin, scheme)
    x = torch.randn(1, quant.DEQUANTIZE_ROWS, 576)
    assert torch.equal(q(x), F.linear(x, q.dequantized(), lin.bias))
    few = q(x[:, :7])
    assert not torch.equal(few, F.linear(x[:, :7], q.dequantized(), lin.bias))  # the kernel: bfloat16 inputs
    torch.testing.assert_close(few, q(x)[:, :7], rtol=2e-2, atol=2e-2)
    if scheme == "int4":
        for N, K in ((576, 576), (192, 576), (1536, 576), (576, 1536)):
            layer = QuantLinear(nn.Linear(K, N, bias=False), "int4")
            assert kernel_block(N, K) in (32, 64)  # the packing this build's int4 kernel uses, found
            eye = torch.eye(K, dtype=torch.bfloat16)
            unit = torch.stack([torch.ones(K // GROUP, N), torch.zeros(K // GROUP, N)], -1).to(torch.bfloat16)
            through = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.qweight, GROUP, unit).float().t() + 8
            assert torch.equal(layer.codes(), through.round().to(torch.int32))


def test_quantization_error_is_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(48, 128) * 0.05
    lin = nn.Linear(128, 48, bias=False)
    lin.weight.data = w.clone()
    step8 = w.abs().amax(1, keepdim=True) / 127
    assert ((QuantLinear(lin, "int8").dequantized() - w).abs() <= step8 / 2 * 1.01 + 1e-7).all()  # bf16 scale
    groups = w.view(48, -1, GROUP)
    step4 = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(GROUP, 1)
    err4 = (QuantLinear(lin, "int4").dequantized() - w).abs()
    assert (err4 <= step4 * 0.5 * 1.05 + 1e-6).all(), (err4 / step4).max()  # bfloat16 scale and zero: 5%
    assert err4.max() > step8.max()  # int4 is coarser: the test tells the two apart


def test_shapes_the_kernels_cannot_take_are_refused():
    with pytest.raises(ValueError, match="int8 needs input features in multiples of 8, got 172"):
        QuantLinear(nn.Linear(172, 64), "int8")  # the kernel crashed the process on it
    with pytest.raises(ValueError, match="multiples of 32"):
        QuantLinear(nn.Linear(40, 64), "int4")
    with pytest.raises(ValueError, match="multiples of 16"):
        QuantLinear(nn.Linear(64, 40), "int4")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_load_model_quantizes_every_projection(pair, scheme):
    plain = tforce.load_model(str(pair / "target")).model
    quant = tforce.load_model(str(pair / "target"), weights=scheme).model
    found = [m for m in quant.modules() if isinstance(m, QuantLinear)]
    assert len(found) == len(PROJECTIONS) * len(quant.model.layers) and {m.scheme for m in found} == {scheme}
    assert quant.weights == scheme
    per_param = {"int8": 1, "int4": 0.5}[scheme]
    projections = sum(p.numel() for layer in plain.model.layers for p in
                      list(layer.self_attn.parameters()) + list(layer.mlp.parameters()))
    saved = weight_bytes(plain) - weight_bytes(quant)
    assert saved > projections * (4 - per_param) * 0.9  # scales and zeros are the rest


def test_load_model_refusals(tmp_path, pair):
    with pytest.raises(UsageError, match="--weights must be"):
        tforce.load_model(str(pair / "target"), weights="int3")
    with pytest.raises(UsageError, match="--weights int8 runs in one process only"):
        tforce.load_model(str(pair / "target"), weights="int8", world=2)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--weights int8: no CUDA device is available"):
            tforce.load_model(str(pair / "target"), device="cuda", weights="int8")
    make_checkpoint(tmp_path / "odd", seed=0)  # intermediate size 172: not in groups of 32, nor of 8
    with pytest.raises(UsageError, match="gate_proj: int4 needs output features in multiples of 16, got 172"):
        tforce.load_model(str(tmp_path / "odd"), weights="int4")
    with pytest.raises(UsageError, match="down_proj: int8 needs input features in multiples of 8, got 172"):
        tforce.load_model(str(tmp_path / "odd"), weights="int8")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("prompt_len", [1, 29])
def test_greedy_equals_plain_decoding_of_the_quantized_model(pair, scheme, prompt_len):
    """Exactness is relative to the model as loaded: every level runs the same quantized projections."""
    target = tforce.load_model(str(pair / "target"), weights=scheme)
    draft = tforce.load_model(str(pair / "draft"))
    prompt = torch.randint(3, 259, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    kw = dict(max_new_tokens=40, temperature=0, ignore_eos=True)
    ar = tforce.generate(target, prompt, method="ar", **kw).tokens
    plain = tforce.generate(tforce.load_model(str(pair / "target")), prompt, method="ar", **kw).tokens
    for method in SPECULATIVE:
        out = tforce.generate(target, prompt, draft=draft, method=method, rebuild_every=8, **SMALL, **kw)
        assert out.tokens == ar, method
        det = tforce.generate(target, prompt, draft=draft, method=method, deterministic=True, **SMALL, **kw)
        assert det.tokens == ar, (method, "deterministic")
    assert len(ar) == 40 and ar != plain or scheme == "int8"  # int4 changes this model's greedy output


def test_bench_weights(pair):
    runner = CliRunner()
    args = ["bench", "--device", "cpu", "-m", str(pair / "target"), "--draft", str(pair / "draft"),
            "--prompt-len", "40", "--gen-len", "6", "-t", "0", "--threads", "1", "--methods", "ar,triforce",
            "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    result = runner.invoke(app, args + ["--weights", "int4", "--peers", "hf"])
    assert result.exit_code == 0, (result.output, result.exception)
    r = json.loads(result.stdout)
    assert r["weights"] == "int4" and plain["weights"] == "auto"
    assert all(p["skipped"].startswith("quantized projections") for p in r["peers"])

    def floor_bytes(report):  # the floor is the bytes a step reads over the bandwidth measured beside it
        return report["runs"][0]["floors"]["step_floor_ms"]["full"] * report["device_gbps"]

    assert floor_bytes(r) < 0.5 * floor_bytes(plain)  # int4 projections: an eighth of their float32 bytes
    table = runner.invoke(app, args[:-1] + ["--weights", "int4"])
    assert "float32, int4 projections, temperature 0.0" in " ".join(table.stdout.split()), table.stdout


@pytest.mark.parametrize("args, needle", [
    (["--weights", "int2"], "--weights must be auto, float, int8, int4, got 'int2'"),
    (["--weights", "int8", "--tp", "2"], "--weights int8 runs in one process only"),
])
def test_bench_weights_refusals(pair, args, needle):
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "-m", str(pair / "target"), "--methods", "ar",
                                      "--prompt-len", "20", "--gen-len", "4"] + args)
    assert result.exit_code == 2 and needle in result.stderr, result.output


def test_quantize_refuses_a_model_on_another_device():
    meta = tforce.model.network.Llama(__import__("tforce.model.synthetic", fromlist=["x"]).make_config())
    with pytest.raises(UsageError, match="--weights int8: quantized weights run on the CPU and CUDA, not meta"):
        quantize(meta.to("meta"), "int8")


def _run_json(pair, *args):
    result = CliRunner().invoke(app, ["run", "-m", str(pair / "target"), "--draft", str(pair / "draft"),
                                      "--prompt", "the cat sat on the mat", "-n", "24", "-t", "0", "--ignore-eos",
                                      "--device", "cpu", "--json", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_run_with_quantized_weights_is_exact_for_every_method(pair, scheme):
    ar = _run_json(pair, "--method", "ar", "--weights", scheme)["tokens"]
    for method in ("triforce", "naive"):
        assert _run_json(pair, "--method", method, "--weights", scheme, "--budget", "16", "--chunk-size", "4",
                         "--draft-budget", "12", "--sinks", "2")["tokens"] == ar, method
    assert ar != _run_json(pair, "--method", "ar")["tokens"] or scheme == "int8"
    note = CliRunner().invoke(app, ["run", "-m", str(pair / "target"), "--draft", str(pair / "draft"), "--prompt",
                                    "x", "-n", "2", "-t", "0", "--device", "cpu", "--weights", scheme,
                                    "--method", "naive"])
    assert f"tforce: note: greedy in {scheme} weights (bfloat16 products)" in note.stderr, note.output


@pytest.mark.parametrize("args, needle", [
    (["--weights", "fp8"], "tforce: error: --weights must be auto, float, int8, int4, got 'fp8'"),
    (["--weights", "int4", "--tp", "2"], "tforce: error: --weights int4 runs in one process only, so far (no --tp/--gpus)"),
])
def test_run_weights_refusals_are_one_line(pair, args, needle):
    result = CliRunner().invoke(app, ["run", "-m", str(pair / "target"), "--prompt", "x", "-n", "2",
                                      "--device", "cpu", *args])
    assert result.exit_code == 2 and result.stderr.strip() == needle, result.output
    assert "Traceback" not in result.output


def test_cuda_nibbles_are_torchaos_packing_of_the_same_codes():
    """The CUDA packer's input (quant.cuda_nibbles of our stored bytes) is the codes two to a byte, column 2j
    in the high nibble, as torchao packs them for `_convert_weight_to_int4pack`: `q[:, ::2] << 4 | q[:, 1::2]`."""
    codes = torch.randint(0, 16, (24, 96), generator=torch.Generator().manual_seed(5))
    stored = quant.pack_int4(codes)
    torchao = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    assert torch.equal(quant.cuda_nibbles(stored), torchao)
    assert torch.equal(quant.cuda_nibbles(torchao), stored)  # swapping twice gives the bytes back
    assert torch.equal(quant.unpack_int4(stored), codes.to(torch.int32))


@pytest.mark.parametrize("K, tiles", [(32, 2), (96, 2), (64, 4), (576, 4), (128, 8), (4096, 8), (11008, 8)])
def test_inner_k_tiles_is_the_widest_the_input_features_take(K, tiles):
    assert quant.inner_k_tiles(K) == tiles and K % (16 * tiles) == 0


def test_shape_rules_per_device():
    """CUDA's rules are looser than the CPU's (int4 outputs by 8, not 16; int8 any shape), and implied by them."""
    shape_problem = quant.shape_problem
    assert shape_problem("int4", 64, 40, "cuda") is None
    assert shape_problem("int4", 64, 40) == "int4 needs output features in multiples of 16, got 40"
    assert shape_problem("int4", 64, 36, "cuda") == "int4 on CUDA needs output features in multiples of 8, got 36"
    assert shape_problem("int4", 40, 64, "cuda") == "int4 needs input features in multiples of 32, got 40"
    assert shape_problem("int8", 172, 64, "cuda") is None and shape_problem("int8", 172, 64) is not None
    for K in range(32, 600, 4):  # whatever the CPU takes, CUDA takes
        for N in (8, 16, 40, 48, 172, 192):
            for scheme in quant.SCHEMES:
                assert shape_problem(scheme, K, N) is not None or shape_problem(scheme, K, N, "cuda") is None


def test_device_problems_and_a_move_the_kernels_cannot_follow():
    assert quant.device_problem("int4", "cpu") is None
    assert quant.device_problem("int8", "meta") == "quantized weights run on the CPU and CUDA, not meta"
    if not torch.cuda.is_available():
        assert quant.device_problem("int4", "cuda") == "no CUDA device is available"
    layer = QuantLinear(nn.Linear(64, 32, bias=False), "int4")
    before = layer.qweight.clone()
    assert layer.to("cpu", torch.bfloat16) is layer and torch.equal(layer.qweight, before)  # nothing repacked
    with pytest.raises(ValueError, match="not meta"):
        layer.to("meta")


@pytest.mark.parametrize("N, K, tiles", [(192, 576, 4), (40, 96, 2), (4096, 11008, 8)])
def test_the_cuda_path_traced_without_a_gpu(monkeypatch, N, K, tiles):
    """The CUDA branch's plumbing on the CPU: under FakeTensorMode tensors on "cuda" carry only shapes and
    dtypes through PyTorch's meta kernels (nothing is computed), so this checks what reaches
    `_convert_weight_to_int4pack` (uint8) and `_weight_int4pack_mm` and the shapes that come back, not the
    values (tests/model/test_quant_cuda.py, on a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        int4 = QuantLinear.stored("int4", torch.empty(N, K // 2, dtype=torch.uint8, device="cuda"),
                                  torch.empty(K // GROUP, N, 2, device="cuda"))
        int8 = QuantLinear.stored("int8", torch.empty(N, K, dtype=torch.int8, device="cuda"),
                                  torch.empty(N, device="cuda"))
        assert int4.qweight.shape == (N // 8, K // (16 * tiles), 32, tiles // 2) and int4.qweight.dtype == torch.int32
        assert int4.scales.dtype == torch.bfloat16 and int4.qweight.is_cuda
        for layer in (int4, int8):
            for dtype in (torch.float32, torch.bfloat16):
                y = layer(torch.empty(2, 5, K, dtype=dtype, device="cuda"))
                assert y.shape == (2, 5, N) and y.dtype == dtype and y.is_cuda
