"""attend (SDPA) against attend_reference (float64), and the reference against a per-head loop."""
from __future__ import annotations

import math

import pytest
import torch

from tforce.model.attention import attend, attend_reference
from tforce.cache import CacheView

D = 16
SHAPES = [(4, 4), (8, 2), (4, 1)]  # (H_q, H_kv): MHA, GQA, MQA


def make_inputs(h_q, h_kv, T, S, mask_heads, seed, dtype=torch.float32):
    """Random q (1, T, H_q, D), view over S keys; a random mask (mask_heads, T, S) that leaves every
    query at least one visible key (the causal diagonal of the last T keys), or None."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, h_q, D, generator=g)
    k = torch.randn(1, S, h_kv, D, generator=g)
    v = torch.randn(1, S, h_kv, D, generator=g)
    mask = None
    if mask_heads:
        mask = torch.rand(mask_heads, T, S, generator=g) < 0.6
        mask[:, torch.arange(T), S - T + torch.arange(T)] = True
    return q.to(dtype), CacheView(k.to(dtype), v.to(dtype), mask)


def plain(q, view):
    """The reference math in the inputs' own precision (flash-attention's `attention_ref` role)."""
    group = q.shape[2] // view.k.shape[2]
    k, v = view.k.repeat_interleave(group, 2), view.v.repeat_interleave(group, 2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    if view.mask is not None:
        scores = scores.masked_fill(~view.mask.repeat_interleave(q.shape[2] // view.mask.shape[0], 0)[None],
                                    float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.float().softmax(-1).to(q.dtype), v)


def per_head_loop(q, view):
    """Independent float64 oracle: one query head at a time, its KV head h // group, its mask row."""
    q, k, v = q.double(), view.k.double(), view.v.double()
    T, h_q, h_kv = q.shape[1], q.shape[2], k.shape[2]
    out = torch.empty(1, T, h_q, D, dtype=torch.float64)
    for h in range(h_q):
        kv = h // (h_q // h_kv)
        for t in range(T):
            s = k[0, :, kv] @ q[0, t, h] / math.sqrt(D)  # (S,)
            if view.mask is not None:
                m = view.mask[0 if view.mask.shape[0] == 1 else kv, t]
                s = s.masked_fill(~m, float("-inf"))
            out[0, t, h] = torch.softmax(s, 0) @ v[0, :, kv]
    return out


CASES = [(h_q, h_kv, T, mask_heads) for h_q, h_kv in SHAPES for T in (1, 5)
         for mask_heads in (None, 1, h_kv)]


@pytest.mark.parametrize("h_q,h_kv,T,mask_heads", CASES)
def test_reference_equals_per_head_loop(h_q, h_kv, T, mask_heads):
    q, view = make_inputs(h_q, h_kv, T, 23, mask_heads, seed=T + 10 * h_q + h_kv)
    view = CacheView(view.k.double(), view.v.double(), view.mask)
    torch.testing.assert_close(attend_reference(q.double(), view), per_head_loop(q, view), atol=1e-12, rtol=0)


@pytest.mark.parametrize("h_q,h_kv,T,mask_heads", CASES)
def test_sdpa_fp32_within_tolerance_of_reference(h_q, h_kv, T, mask_heads):
    q, view = make_inputs(h_q, h_kv, T, 37, mask_heads, seed=100 + T + 10 * h_q + h_kv)
    ref = attend_reference(q.double(), CacheView(view.k.double(), view.v.double(), view.mask))
    err = (attend(q, view).double() - ref).abs().max().item()
    err_plain = (plain(q, view).double() - ref).abs().max().item()
    assert err <= max(2 * err_plain, 2e-6), (err, err_plain)


@pytest.mark.parametrize("h_q,h_kv,T,mask_heads", CASES)
def test_sdpa_bf16_within_twice_plain_error(h_q, h_kv, T, mask_heads):
    """flash-attention's rule: error vs float64 at most twice that of the same-precision plain reference."""
    q, view = make_inputs(h_q, h_kv, T, 64, mask_heads, seed=200 + T + 10 * h_q + h_kv, dtype=torch.bfloat16)
    ref = attend_reference(q.double(), CacheView(view.k.double(), view.v.double(), view.mask))
    err = (attend(q, view).double() - ref).abs().max().item()
    err_plain = (plain(q, view).double() - ref).abs().max().item()
    assert err_plain > 0
    assert err <= 2 * err_plain, (err, err_plain)


def test_mask_hides_keys():
    """Changing a masked-out key or value leaves the output alone; changing a visible one does not."""
    q, view = make_inputs(8, 2, 3, 10, 2, seed=5)
    view.mask[1, :, 2] = False  # key 2 of KV head 1: hidden from every query (keys 7..9 stay visible)
    view.mask[1, 0, 4] = True
    out = attend(q, view)
    k2, v2 = view.k.clone(), view.v.clone()
    k2[0, 2, 1] += 5.0
    v2[0, 2, 1] += 5.0
    torch.testing.assert_close(attend(q, CacheView(k2, v2, view.mask)), out, atol=0, rtol=0)
    v2[0, 4, 1] += 5.0
    changed = (attend(q, CacheView(k2, v2, view.mask)) - out).abs().amax(dim=-1)[0]  # (T, H_q)
    assert (changed[0, 4:] > 1e-3).all()  # query 0 of heads 4..7 (KV head 1's group) sees key 4
    assert (changed[:, :4] == 0).all()  # KV head 0's group is untouched


def test_all_true_mask_equals_no_mask():
    q, view = make_inputs(8, 2, 4, 12, None, seed=6)
    full = CacheView(view.k, view.v, torch.ones(2, 4, 12, dtype=torch.bool))
    torch.testing.assert_close(attend(q, full), attend(q, view), atol=1e-6, rtol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("h_q,h_kv", SHAPES)
@pytest.mark.parametrize("T", [1, 7])
def test_flash_matches_sdpa_on_cuda(h_q, h_kv, T):
    """flash-attn vs SDPA in bf16, both against float64: flash's error at most twice SDPA's + eps."""
    from tforce.model.attention import flash_attn_func
    from tforce.cache.base import visibility

    if flash_attn_func is None:
        pytest.skip("flash-attn is not installed on this CUDA machine")
    S = 300
    q, view = make_inputs(h_q, h_kv, T, S, 0, seed=T + h_kv, dtype=torch.bfloat16)
    pos = torch.arange(S - T, S)
    mask = visibility(torch.arange(S)[None], pos) if T > 1 else None
    view = CacheView(view.k.cuda(), view.v.cuda(), None if mask is None else mask.cuda(), causal=True)
    q = q.cuda()
    ref = attend_reference(q.double(), CacheView(view.k.double(), view.v.double(), view.mask))
    err_flash = (attend(q, view).double() - ref).abs().max()
    err_sdpa = (attend(q, view, use_flash=False).double() - ref).abs().max()
    assert err_flash <= 2 * err_sdpa + 1e-3


def causal_view(h_kv, T, S, seed, dtype=torch.float32):
    """A full-cache view: the T queries are the last T of S keys, bottom-right causal (view.causal)."""
    from tforce.cache.base import visibility

    _, view = make_inputs(1, h_kv, T, S, None, seed, dtype)
    mask = visibility(torch.arange(S)[None], torch.arange(S - T, S)) if T > 1 else None
    return CacheView(view.k, view.v, mask, causal=True)


@pytest.mark.parametrize("h_q,h_kv", SHAPES)
@pytest.mark.parametrize("T", range(1, 10))
@pytest.mark.parametrize("kind", ["causal", "per_head"])
def test_folded_gqa_matches_reference_for_every_query_length(h_q, h_kv, T, kind):
    """The GQA fold (query heads of a KV head stacked along the query axis) against float64."""
    S = 41
    if kind == "causal":
        view = causal_view(h_kv, T, S, seed=T)
    else:
        _, view = make_inputs(h_q, h_kv, T, S, h_kv, seed=T)
    q = torch.randn(1, T, h_q, D, generator=torch.Generator().manual_seed(300 + T))
    ref = attend_reference(q.double(), CacheView(view.k.double(), view.v.double(), view.mask))
    torch.testing.assert_close(attend(q, view).double(), ref, atol=2e-6, rtol=0)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor (in bytes) that any aten op produces inside the block."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("mask_heads", [1, 2])
def test_masked_gqa_never_materialises_kv_per_query_head(mask_heads):
    """With a mask, SDPA's enable_gqa runs the math backend (CUDA's choice for masked GQA, forced here),
    which repeats K/V for every query head in float32: 8x K's bytes for this 8:2 bf16 shape. The fold
    keeps every intermediate at most a float32 copy of K (2x its bytes): O(S x H_kv), not O(S x H_q)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h_q, h_kv, T, S = 8, 2, 4, 2048
    q, view = make_inputs(h_q, h_kv, T, S, mask_heads, seed=7, dtype=torch.bfloat16)
    k_bytes = view.k.numel() * view.k.element_size()
    with sdpa_kernel([SDPBackend.MATH]), _LargestTensor() as probe:
        attend(q, view)
    assert probe.largest <= 2 * k_bytes, (probe.largest, k_bytes)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 7])
def test_sdpa_on_cuda_never_runs_cudnn_and_stays_exact(T):
    """cuDNN attention cost 2.7 ms of host time per call on an H100 (a graph per key length): attend()
    keeps SDPA off it. Checked in the profiler's op names, and against float64."""
    from torch.profiler import ProfilerActivity, profile

    from tforce.cache.base import visibility

    S = 1000
    q, view = make_inputs(32, 8, T, S, 0, seed=T, dtype=torch.bfloat16)
    mask = visibility(torch.arange(S)[None], torch.arange(S - T, S)) if T > 1 else None
    view = CacheView(view.k.cuda(), view.v.cuda(), None if mask is None else mask.cuda(), causal=True)
    q = q.cuda()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = attend(q, view, use_flash=False)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    # the profile saw the call (a causal T > 1 goes straight to the flash op: lower_right's bias dispatches it)
    assert names & {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention"}
    assert not any("cudnn" in n for n in names), sorted(names)
    ref = attend_reference(q.double(), CacheView(view.k.double(), view.v.double(), view.mask))
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("h_q,h_kv", SHAPES)
@pytest.mark.parametrize("T", [1, 2, 7])
def test_lower_right_form_matches_reference(h_q, h_kv, T):
    """The form CUDA's causal verifications take (a lower-right causal bias, GQA by enable_gqa) computes the
    view's masked attention: the T queries see the keys up to their own, the last T of S."""
    from tforce.model.attention import lower_right

    S = 41
    view = causal_view(h_kv, T, S, seed=10 + T)
    q = torch.randn(1, T, h_q, D, generator=torch.Generator().manual_seed(400 + T))
    ref = attend_reference(q.double(), CacheView(view.k.double(), view.v.double(), view.mask))
    torch.testing.assert_close(lower_right(q, view).double(), ref, atol=2e-6, rtol=0)


def test_flash_lower_right_falls_back_once_where_flash_refuses(monkeypatch):
    """Where SDPA's flash backend refuses the call (an older GPU, an odd head dim), attend() keeps the masked
    path, and asks flash once per kind, not at every layer."""
    from tforce.model import attention

    calls = []

    def refuse(q, view):
        calls.append(1)
        raise RuntimeError("No available kernel")

    monkeypatch.setattr(attention, "lower_right", refuse)
    monkeypatch.setattr(attention, "_FLASH_TAKES_LOWER_RIGHT", {})
    view = causal_view(2, 5, 30, seed=1)
    q = torch.randn(1, 5, 8, D)
    assert attention._flash_lower_right(q, view) is None and attention._flash_lower_right(q, view) is None
    assert calls == [1]


@pytest.mark.cuda
@pytest.mark.parametrize("h_q,h_kv", [(32, 32), (32, 8)])
def test_causal_verification_on_cuda_runs_flash_without_a_mask(h_q, h_kv):
    """A verification's queries over the full cache on CUDA: SDPA's flash kernel (lower-right bias), not the
    memory-efficient kernel with a materialised mask (11x slower at 131K keys on an H200), and exact."""
    from torch.profiler import ProfilerActivity, profile

    from tforce.cache.base import visibility

    S, T = 1000, 7
    q, view = make_inputs(h_q, h_kv, T, S, 0, seed=3, dtype=torch.bfloat16)
    mask = visibility(torch.arange(S)[None], torch.arange(S - T, S))
    view = CacheView(view.k.cuda(), view.v.cuda(), mask.cuda(), causal=True)
    q = q.cuda()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = attend(q, view, use_flash=False)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention" in names, sorted(names)
    assert "aten::_efficient_attention_forward" not in names, sorted(names)
    ref = attend_reference(q.double(), CacheView(view.k.double(), view.v.double(), view.mask))
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2
