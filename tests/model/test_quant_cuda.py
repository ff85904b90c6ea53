"""Quantized projections on CUDA (tforce/model/quant.py, its module docstring): int4 through PyTorch's tinygemm
kernel, int8 by its weight dequantized per call. Their products against the float32 reference they stand
for, the codes kept through packing and across devices, every method's greedy tokens equal to `ar` on a
tiny model quantized on the GPU, and a GGUF's int4 projections kept int4 there. Needs a CUDA GPU (int4
one of compute capability 8.0 or later); scripts/gpu_check.sh and scripts/gpu_features.sh run them.
The helpers the CPU can check (the CUDA nibble order, the tiles, the shape rules) are in test_quant.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tforce
from tforce.model.quant import GROUP, PROJECTIONS, QuantLinear, pack_int4, weight_bytes
from tforce.model.synthetic import make_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
INT4 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
needs_int4 = pytest.mark.skipif(not INT4, reason="int4 on CUDA needs compute capability 8.0 or later")
SCHEMES = [pytest.param("int8"), pytest.param("int4", marks=needs_int4)]
SPECULATIVE = ["triforce", "retrieval", "streaming", "naive"]
SMALL = dict(budget=16, chunk_size=4, draft_budget=12, sinks=2, gamma1=2, gamma2=4)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # a decode step, a verification, a prefill chunk: all the kernel
@pytest.mark.parametrize("bias", [False, True])
def test_products_against_the_dequantized_reference(scheme, rows, bias):
    """The product is x (rounded to bfloat16) times the float32 weight dequantized() reports, within two
    roundings to bfloat16 (8 significant bits: each dequantized weight, and the output), 2^-7 sum |x_k w_k|
    at most; the bound is twice that, for cuBLAS's reduced-precision reductions in bfloat16 (int8's product,
    which torch allows by default)."""
    torch.manual_seed(0)
    lin = nn.Linear(576, 192, bias=bias).cuda()
    q = QuantLinear(lin, scheme)
    x = torch.randn(1, rows, 576, device="cuda")
    xb = x.to(torch.bfloat16).float()
    w = q.dequantized()
    got = q(x)
    assert got.shape == (1, rows, 192) and got.dtype == torch.float32 and q.qweight.is_cuda
    ref = F.linear(xb, w, lin.bias)
    bound = 2.0 ** -6 * (xb.abs() @ w.abs().t()) + 1e-6
    assert ((got - ref).abs() <= bound).all(), ((got - ref).abs() / bound).max()
    assert q(x.to(torch.bfloat16)).dtype == torch.bfloat16  # the input's dtype back


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantization_error_is_within_half_a_step(scheme):
    """The weight quantized on the GPU is the original within half a step: a wrong nibble order would put
    every odd column in its even neighbour's place, far outside it."""
    torch.manual_seed(1)
    w = torch.randn(48, 128) * 0.05
    lin = nn.Linear(128, 48, bias=False)
    lin.weight.data = w.clone()
    err = (QuantLinear(lin.cuda(), scheme).dequantized().cpu() - w).abs()
    if scheme == "int8":
        step = w.abs().amax(1, keepdim=True) / 127
        assert (err <= step / 2 * 1.01 + 1e-7).all()
    else:
        g = w.view(48, -1, GROUP)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(GROUP, 1)
        assert (err <= step * 0.5 * 1.05 + 1e-6).all(), (err / step).max()


@needs_int4
@pytest.mark.parametrize("N, K", [(192, 576), (40, 96), (4096, 128)])  # tiles 4, 2, 8; 40 rows: by 8, not 16
def test_int4_codes_round_trip(N, K):
    codes = torch.randint(0, 16, (N, K), generator=torch.Generator().manual_seed(N))
    sz = torch.rand(K // GROUP, N, 2).to(torch.bfloat16)
    layer = QuantLinear.stored("int4", pack_int4(codes).cuda(), sz.cuda())
    assert layer.qweight.dim() == 4  # tinygemm's own layout
    assert torch.equal(layer.codes().cpu(), codes.to(torch.int32))
    assert torch.equal(layer.stored_form()[0].cpu(), pack_int4(codes))


@needs_int4
def test_moving_a_module_repacks_it_for_the_device():
    """Module.to between the CPU and CUDA packs int4 again for the kernel there; back on the CPU it is the
    CPU module byte for byte, so its products are too."""
    torch.manual_seed(2)
    cpu = QuantLinear(nn.Linear(576, 192, bias=True), "int4")
    moved = copy.deepcopy(cpu).to("cuda")
    assert moved.qweight.dim() == 4 and moved.scales.is_cuda and moved.bias.is_cuda
    assert torch.equal(moved.codes().cpu(), cpu.codes())
    x = torch.randn(3, 576)
    torch.testing.assert_close(moved(x.cuda()).cpu(), cpu(x), rtol=2e-2, atol=2e-2)
    moved.cpu()
    assert torch.equal(moved.qweight, cpu.qweight) and torch.equal(moved(x), cpu(x))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_cuda")
    make_checkpoint(root / "target", seed=3, num_key_value_heads=2, hidden_size=64, intermediate_size=128)
    make_checkpoint(root / "draft", seed=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, num_hidden_layers=1)
    return root


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_equals_plain_decoding_of_the_model_quantized_on_cuda(pair, scheme):
    """As tests/model/test_quant.py on the CPU: every level runs the same projections, so every method's greedy
    tokens are `ar`'s on the quantized model (float32 activations around bfloat16 products, as there)."""
    target = tforce.load_model(str(pair / "target"), device="cuda", dtype=torch.float32, weights=scheme)
    draft = tforce.load_model(str(pair / "draft"), device="cuda", dtype=torch.float32)
    found = [m for m in target.model.modules() if isinstance(m, QuantLinear)]
    assert len(found) == len(PROJECTIONS) * len(target.model.model.layers)
    assert all(m.qweight.is_cuda for m in found) and target.model.weights == scheme
    prompt = torch.randint(3, 259, (29,), generator=torch.Generator().manual_seed(29)).tolist()
    kw = dict(max_new_tokens=40, temperature=0, ignore_eos=True)
    ar = tforce.generate(target, prompt, method="ar", **kw).tokens
    assert len(ar) == 40
    for method in SPECULATIVE:
        out = tforce.generate(target, prompt, draft=draft, method=method, rebuild_every=8, **SMALL, **kw)
        assert out.tokens == ar, method
        det = tforce.generate(target, prompt, draft=draft, method=method, deterministic=True, **SMALL, **kw)
        assert det.tokens == ar, (method, "deterministic")


@needs_int4
def test_a_gguf_stays_int4_on_cuda(tmp_path, monkeypatch):
    """A GGUF's stored int4 projections load as int4 on the GPU (packed there, not dequantized): the file's
    codes, the bytes counted as packed (the same as on the CPU), and greedy speculation equal to `ar`."""
    gguf = pytest.importorskip("gguf")
    from gguf_files import write_llama

    monkeypatch.setenv("TFORCE_CACHE", str(tmp_path / "cache"))
    file = write_llama(tmp_path / "q4.gguf", seed=2, qtype=gguf.GGMLQuantizationType.Q4_1, intermediate_size=128)
    on_cpu = tforce.load_model(str(file))
    on_gpu = tforce.load_model(str(file), device="cuda", dtype=torch.float32)
    assert on_gpu.model.weights == "int4"
    for a, b in zip(on_cpu.model.model.layers, on_gpu.model.model.layers):
        for name in ("q_proj", "v_proj"):
            p, g = getattr(a.self_attn, name), getattr(b.self_attn, name)
            assert isinstance(g, QuantLinear) and g.qweight.is_cuda and g.qweight.dim() == 4
            assert torch.equal(g.codes().cpu(), p.codes())
    assert weight_bytes(on_gpu.model) == weight_bytes(on_cpu.model)  # int4 packed: half a byte a weight on both
    prompt = list(range(5, 85))
    kw = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True, budget=32, chunk_size=4)
    ar = tforce.generate(on_gpu, prompt, method="ar", **kw).tokens
    assert tforce.generate(on_gpu, prompt, method="triforce", draft=on_gpu, **kw).tokens == ar
