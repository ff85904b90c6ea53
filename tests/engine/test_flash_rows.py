"""Rows of different lengths on flash-attn's kvcache kernel (CacheView.seqlens as cache_seqlens).

flash-attn is installed on no machine these tests run on, so the kernel is stood in for by its documented
semantics (flash_attn_interface.flash_attn_with_kvcache: row b attends to its first cache_seqlens[b] keys,
causal=True aligns the T queries with the last T of them), computed here from cache_seqlens alone, never
from our masks. What is checked: every ragged view's seqlens say exactly what its mask says, and a batch of
rows of different lengths attending through the stand-ins gives each row what it gives alone.
"""
from __future__ import annotations

import pytest
import torch

import tforce
import tforce.model.attention as attention
from tforce.cache import CacheView, FullCache
from tforce.cache.offload import OffloadedCache
from tforce.cache.rope import Rotary
from tforce.cache.streaming import StreamingCache
from tforce.engine.batch import generate_batch

from model_helpers import rotary_for

L, H, D = 2, 2, 16  # D: the tiny checkpoints' head dimension (their rotary)


def bottom_right(T: int, n: int) -> torch.Tensor:
    """(1, T, n): query t sees keys s <= n - T + t (flash-attn's causal alignment)."""
    return (torch.arange(n)[None] <= n - T + torch.arange(T)[:, None])[None]


def one_row(q, k, v, n: int, causal: bool) -> torch.Tensor:
    """Row q (1, T, H_q, D) over the first n keys of k, v (1, S, H_kv, D), in float64."""
    T = q.shape[1]
    mask = bottom_right(T, n) if causal else None
    return attention.attend_reference(q, CacheView(k[:, :n], v[:, :n], mask)).to(q.dtype)


class StandIns:
    def __init__(self):
        self.ragged: list[list[int]] = []  # the cache_seqlens of each kvcache call whose rows differ

    def kvcache(self, q, k_cache, v_cache, cache_seqlens=None, causal=False):
        assert causal and cache_seqlens.dtype == torch.int32 and k_cache.stride(-1) == 1
        lens = cache_seqlens.tolist()
        assert len(lens) == q.shape[0] and all(q.shape[1] <= n <= k_cache.shape[1] for n in lens)
        if len(set(lens)) > 1:
            self.ragged.append(lens)
        return torch.cat([one_row(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1], n, True)
                          for b, n in enumerate(lens)])

    def func(self, q, k, v, causal=False):
        return torch.cat([one_row(q[b:b + 1], k[b:b + 1], v[b:b + 1], k.shape[1], causal) for b in range(len(q))])


@pytest.fixture
def flash(monkeypatch):
    """attend() takes the flash-attn calls on the CPU in float32, through the stand-ins."""
    s = StandIns()
    monkeypatch.setattr(attention, "flash_attn_func", s.func)
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", s.kvcache)
    monkeypatch.setattr(attention, "flash_usable", lambda q, view: view.causal or view.seqlens is not None)
    return s


def check_view(view: CacheView, T: int) -> None:
    """The view's seqlens say what its mask says: slot s visible to row b's query t iff s <= seqlens[b] - T + t."""
    assert view.seqlens is not None and view.mask is not None and not view.causal
    B, S = view.k.shape[:2]
    assert view.mask.shape == (B, 1, T, S) and view.seqlens.shape == (B,) and int(view.seqlens.max()) <= S
    for b, n in enumerate(view.seqlens.tolist()):
        expected = torch.zeros(T, S, dtype=torch.bool)
        expected[:, :n] = bottom_right(T, n)[0]
        assert torch.equal(view.mask[b, 0], expected), (b, n)


def drive(cache, steps: int, rows: int, seed: int, max_n: int, subsets: bool = False) -> int:
    """Ragged forwards with random counts (and random rows sitting out, for caches that allow it), each
    layer's view checked; returns how many views were ragged."""
    g = torch.Generator().manual_seed(seed)
    checked = 0
    for _ in range(steps):
        n = int(torch.randint(1, max_n + 1, (1,), generator=g))
        fed = [b for b in range(rows) if not subsets or torch.rand(1, generator=g) < 0.7] or [0]
        counts = torch.randint(1, n + 1, (len(fed),), generator=g).tolist()
        counts[0] = n
        if subsets and len(fed) < rows:
            cache.begin(n, counts, fed)
        else:
            cache.begin(n, counts)
        for layer in range(L):
            q = torch.randn(len(fed), n, H, D, generator=g)
            k, v = torch.randn(len(fed), n, H, D, generator=g), torch.randn(len(fed), n, H, D, generator=g)
            _, view = cache.update(layer, q, k, v)
            if view.seqlens is not None:
                check_view(view, n)
                checked += 1
            else:  # one shared view: every row at one length, causal
                assert view.causal
        if subsets:
            full_counts = [0] * rows
            for b, c in zip(fed, counts):
                full_counts[b] = c
            cache.commit(full_counts)
        else:
            cache.commit(counts)
    return checked


def test_full_cache_seqlens_say_what_its_mask_says(tiny):
    cache = FullCache(L, H, D, 256, rotary_for(tiny["gqa"], 256), rows=3)
    assert drive(cache, 30, 3, seed=0, max_n=5) > 0


def test_offloaded_cache_seqlens_say_what_its_mask_says(tiny):
    # resident 1 of 2 layers: the resident layer's view and the staged layer's
    cache = OffloadedCache(L, H, D, 256, rotary_for(tiny["gqa"], 256), resident=1, rows=3)
    assert drive(cache, 30, 3, seed=1, max_n=5) > 0


@pytest.mark.parametrize("sinks", [0, 2])
def test_streaming_cache_seqlens_say_what_its_mask_says(tiny, sinks):
    """A 12-slot window that slides and compacts, rows sitting forwards out."""
    cache = StreamingCache(L, H, D, 12, sinks, rotary_for(tiny["gqa"], 512), 4, 8, rows=3)
    assert drive(cache, 60, 3, seed=2 + sinks, max_n=4, subsets=True) > 0


@pytest.mark.parametrize("method", ["triforce", "naive", "streaming"])
def test_ragged_rows_through_the_kvcache_kernel_equal_alone(tiny, flash, method):
    """Rows of different lengths attend through flash_attn_with_kvcache (the stand-in) and give what each
    prompt gives alone, token for token and with the same acceptance."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (1, 13, 37, 5)]
    kw = dict(draft=tiny["draft"], method=method, max_new_tokens=24, temperature=0, ignore_eos=True,
              draft_budget=12, sinks=2, gamma2=4, prefill_chunk=8, budget=16, chunk_size=4)
    rows = generate_batch(tiny["gqa"], prompts, **kw)
    assert flash.ragged, "no forward of rows of different lengths reached the kvcache kernel"
    for prompt, row in zip(prompts, rows):
        alone = tforce.generate(tiny["gqa"], prompt, **kw)
        assert row.tokens == alone.tokens
        assert row.stats["acceptance"] == alone.stats["acceptance"]


@pytest.mark.cuda
def test_the_kvcache_kernel_matches_sdpa_on_ragged_rows_on_cuda(tiny):
    """The real kernel where it is installed: a ragged full-cache view in bf16, flash-attn's error against
    float64 at most twice SDPA's (with the mask) + eps."""
    if attention.flash_attn_with_kvcache is None:
        pytest.skip("flash-attn is not installed on this CUDA machine")
    rotary = Rotary(tiny["gqa"].model.config, max_len=256, device="cuda")
    cache = FullCache(L, H, D, 256, rotary, dtype=torch.bfloat16, device="cuda", rows=3)
    g = torch.Generator(device="cuda").manual_seed(5)
    for n, counts in ((40, [40, 31, 7]), (6, [6, 2, 5])):
        cache.begin(n, counts)
        q = torch.randn(3, n, 2 * H, D, generator=g, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(3, n, H, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q, view = cache.update(0, q, k, v)
        cache.update(1, q, k, v)
        cache.commit(counts)
    assert view.seqlens is not None
    ref = attention.attend_reference(q.double(), CacheView(view.k.double(), view.v.double(), view.mask))
    err_flash = (attention.attend(q, view).double() - ref).abs().max()
    err_sdpa = (attention.attend(q, view, use_flash=False).double() - ref).abs().max()
    assert err_flash <= 2 * err_sdpa + 1e-3
