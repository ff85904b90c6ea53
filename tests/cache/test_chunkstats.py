"""Chunk statistics for retrieval rebuilds: incremental == from scratch, bit for bit; a rebuild of an
offloaded cache reads O(budget + new tokens) rows of host KV, not O(context); the engine stays exact."""
from __future__ import annotations

import pytest
import torch

import tforce
from model_helpers import forward, random_ids
from tforce.cache import RetrievalCache
from tforce.cache.chunkstats import ChunkStats, chunk_stats_bytes, chunk_sums
from tforce.cache.offload import OffloadedCache
from tforce.engine.prefill import prefill_layer_major

from cache_helpers import PATTERNS, last_queries, make_full, retrieval


def from_scratch(full, chunk: int) -> list[torch.Tensor]:
    """Per layer, the float32 sum of every complete chunk of the committed keys, in one go."""
    n = full.length // chunk
    return [chunk_sums(full.layer_keys(layer)[0, :n * chunk], chunk) for layer in range(full.n_layers)]


def assert_stats_exact(cache: RetrievalCache, full, chunk: int) -> None:
    stats = cache.stats[0]
    for layer, want in enumerate(from_scratch(full, chunk)):
        assert stats.chunks[layer] == len(want), layer
        assert torch.equal(stats.sums[layer][:len(want)], want), layer


def test_chunk_sums_do_not_depend_on_how_many_chunks_are_summed_together():
    rows = torch.randn(9 * 8, 3, 16, generator=torch.Generator().manual_seed(0))
    whole = chunk_sums(rows, 8)
    pieces = torch.cat([chunk_sums(rows[a * 8:b * 8], 8) for a, b in [(0, 1), (1, 4), (4, 9)]])
    assert torch.equal(whole, pieces)
    torch.testing.assert_close(whole, rows.view(9, 8, 3, 16).sum(1))


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("offloaded,resident", [(False, 0), (True, 0), (True, 1)])
def test_incremental_stats_equal_a_from_scratch_computation(tiny, pattern, offloaded, resident):
    model = tiny["gqa"].model
    ids = random_ids(120, seed=1)
    full = make_full(model, 128, offloaded, resident)
    cache = retrieval(model, full, budget=16, chunk=8)
    pos = 0
    for fed, kept in PATTERNS[pattern]:
        forward(model, full, ids[:, pos:pos + fed], keep=fed)
        full.truncate(pos + kept)  # a rejected speculation: the tail is rolled back
        pos += kept
        cache.rebuild(full, [0], [last_queries(full)])
        assert_stats_exact(cache, full, 8)


def test_stats_follow_a_rollback_below_what_they_cover(tiny):
    """The full cache rolled back under summed chunks and refilled with other tokens: the chunks the
    rollback cut into are summed again from the new rows."""
    model = tiny["gqa"].model
    full = make_full(model, 128, offloaded=True)
    cache = retrieval(model, full, budget=16, chunk=8)
    forward(model, full, random_ids(45, seed=2))
    cache.rebuild(full, [0], [last_queries(full)])
    full.truncate(30)
    cache.rebuild(full, [0], [last_queries(full)])  # a rebuild sees the shorter cache ...
    forward(model, full, random_ids(20, seed=3))  # ... before other tokens replace 30..44
    cache.rebuild(full, [0], [last_queries(full)])
    assert_stats_exact(cache, full, 8)


@pytest.mark.parametrize("resident", [0, 1])
def test_layer_major_prefill_stats_equal_a_from_scratch_computation(tiny, resident):
    model = tiny["gqa"].model
    full = make_full(model, 128, offloaded=True, resident=resident)
    cache = retrieval(model, full, budget=16, chunk=8)
    prefill_layer_major(model, [random_ids(61, seed=4)[0]], full, chunk=16,
                        on_layer=lambda i, k: cache.observe(full, i, k))
    assert cache.stats[0].chunks == [7, 7]
    full.host_rows_read = 0
    cache.rebuild(full, [0], [last_queries(full)])
    assert_stats_exact(cache, full, 8)
    # Nothing re-read for the statistics: 5 partial-chunk rows + 16 selected rows per offloaded layer.
    assert full.host_rows_read == (2 - resident) * (5 + 16)


@pytest.mark.parametrize("shared", [False, True])
def test_a_rebuild_reads_budget_plus_new_rows_of_host_kv(tiny, shared):
    """Context 10x the budget: the first rebuild after a layer-major prefill and later ones after new
    tokens read at most budget + new tokens + one chunk rows per offloaded layer."""
    model = tiny["gqa"].model
    budget, chunk, n_layers = 24, 8, model.config.num_hidden_layers
    ids = random_ids(300, seed=5)
    full = make_full(model, 320, offloaded=True)
    cache = retrieval(model, full, budget, chunk, shared=shared)
    prefill_layer_major(model, [ids[0, :240]], full, chunk=64, on_layer=lambda i, k: cache.observe(full, i, k))
    start = 240
    for new in (0, 1, 13, 30):
        forward(model, full, ids[:, start:start + new]) if new else None
        start += new
        full.host_rows_read = 0
        cache.rebuild(full, [0], [last_queries(full)])
        assert 0 < full.host_rows_read <= n_layers * (budget + new + chunk), (new, full.host_rows_read)
        assert_stats_exact(cache, full, chunk)
        ref = retrieval(model, full, budget, chunk, shared=shared)  # from scratch (reads every row)
        ref.rebuild(full, [0], [last_queries(full)])
        assert torch.equal(cache.key_pos, ref.key_pos) and torch.equal(cache.k, ref.k)
        assert torch.equal(cache.v, ref.v)


def test_offloaded_selection_equals_the_resident_one(tiny):
    """Where the statistics live does not change what is chosen or held."""
    model = tiny["mha"].model
    ids = random_ids(77, seed=6)
    caches = []
    for offloaded in (False, True):
        full = make_full(model, 128, offloaded)
        forward(model, full, ids)
        cache = retrieval(model, full, budget=32, chunk=4)
        cache.rebuild(full, [0], [last_queries(full)])
        caches.append(cache)
    assert torch.equal(caches[0].key_pos, caches[1].key_pos) and torch.equal(caches[0].k, caches[1].k)


def test_chunk_stats_bytes_is_what_is_allocated(tiny):
    model = tiny["gqa"].model
    full = make_full(model, 100, offloaded=True, resident=1)
    stats = ChunkStats.for_cache(full, 8)
    per_layer = chunk_stats_bytes(100, 8, model.n_kv_heads, model.head_dim)
    assert per_layer == 12 * model.n_kv_heads * model.head_dim * 4
    assert [s.numel() * s.element_size() for s in stats.sums] == [per_layer] * 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_offloaded_triforce_with_rebuilds_equals_ar(tiny, temperature):
    """offload='on', budget < context, rebuilds mid-generation: tokens identical to plain decoding
    (greedy) and to the resident run (sampling); the rebuilds are counted and timed."""
    prompt = random_ids(70, seed=7)[0].tolist()
    kw = dict(max_new_tokens=40, temperature=temperature, seed=11, ignore_eos=True)
    ar = tforce.generate(tiny["gqa"], prompt, method="ar", offload="on", **kw)
    spec = dict(draft=tiny["draft"], method="triforce", budget=16, chunk_size=4, rebuild_every=8, **kw)
    on = tforce.generate(tiny["gqa"], prompt, offload="on", **spec)
    off = tforce.generate(tiny["gqa"], prompt, offload="off", **spec)
    assert on.tokens == off.tokens
    if temperature == 0:
        assert on.tokens == ar.tokens
    assert on.stats["rebuilds"] >= 4 and on.stats["rebuild_s"] > 0 and on.stats["prefill_rebuild_s"] > 0
    assert ar.stats["rebuilds"] is None and ar.stats["rebuild_s"] is None


@pytest.mark.cuda
def test_on_cuda_stats_live_next_to_their_layer_and_tokens_stay_exact(tiny_dir):
    from tforce.cache.rope import Rotary

    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32)
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32)
    model = target.model
    dims = (model.config.num_hidden_layers, model.n_kv_heads, model.head_dim)
    full = OffloadedCache(*dims, capacity=128, rotary=Rotary(model.config, 128, device="cuda"), resident=1,
                          device="cuda")
    stats = ChunkStats.for_cache(full, 8)
    assert stats.sums[0].device.type == "cuda"
    assert stats.sums[1].device.type == "cpu" and stats.sums[1].is_pinned()
    prompt = list(range(3, 120))
    kw = dict(max_new_tokens=40, temperature=0.0, ignore_eos=True, offload="on")
    ar = tforce.generate(target, prompt, method="ar", **kw)
    on = tforce.generate(target, prompt, draft=draft, method="triforce", budget=32, chunk_size=4, draft_budget=24,
                         sinks=4, rebuild_every=8, **kw)
    assert on.tokens == ar.tokens and on.stats["rebuilds"] >= 4
