"""Chunk statistics not kept for resident layers (placement.Plan.recompute_stats): every rebuild sums those
layers' chunks from their keys and must select and hold exactly what kept statistics give; the planner
gives them up before it offloads a layer; the engine and batches honour the plan and stay exact."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tforce
import tforce.engine.nodes
from model_helpers import forward, random_ids
from tforce.config import Speculation
from tforce.engine import placement
from tforce.cache.chunkstats import ChunkStats
from tforce.errors import TforceError
from tforce.engine.placement import GiB

from cache_helpers import PATTERNS, last_queries, make_full, retrieval
from placement_helpers import shapes, work


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("offloaded,resident", [(False, 0), (True, 1)])
def test_recomputed_selection_equals_the_kept_one_bit_for_bit(tiny, pattern, offloaded, resident, shared):
    model = tiny["gqa"].model
    ids = random_ids(120, seed=1)
    full = make_full(model, 128, offloaded, resident)
    kept = retrieval(model, full, budget=16, chunk=8, shared=shared)
    redone = retrieval(model, full, budget=16, chunk=8, shared=shared)
    redone.recompute_stats = True
    pos = 0
    for fed, n in PATTERNS[pattern]:
        forward(model, full, ids[:, pos:pos + fed], keep=fed)
        full.truncate(pos + n)  # a rejected speculation: the tail is rolled back
        pos += n
        for cache in (kept, redone):
            cache.rebuild(full, [0], [last_queries(full)])
        assert torch.equal(kept.key_pos, redone.key_pos)
        assert torch.equal(kept.k, redone.k) and torch.equal(kept.v, redone.v)
    # On a CPU run host memory is the compute device's: no layer keeps its sums (on CUDA: tested below).
    assert all(s is None for s in redone.stats[0].sums)


@pytest.mark.cuda
def test_on_cuda_offloaded_layers_keep_their_statistics_and_resident_ones_do_not(tiny_dir):
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32).model
    from tforce.cache.offload import OffloadedCache
    from tforce.cache.rope import Rotary

    dims = (target.config.num_hidden_layers, target.n_kv_heads, target.head_dim)
    full = OffloadedCache(*dims, capacity=128, rotary=Rotary(target.config, 128, device="cuda"), resident=1,
                          device="cuda")
    forward(target, full, random_ids(77, seed=6).cuda())
    caches = [retrieval(target, full, budget=32, chunk=8) for _ in range(2)]
    caches[1].recompute_stats = True
    for cache in caches:
        cache.key_pos, cache.k, cache.v = cache.key_pos.cuda(), cache.k.cuda(), cache.v.cuda()
        cache.rebuild(full, [0], [last_queries(full)])
    sums = caches[1].stats[0].sums
    assert sums[0] is None and sums[1].device.type == "cpu" and sums[1].is_pinned()
    assert torch.equal(caches[0].key_pos, caches[1].key_pos) and torch.equal(caches[0].k, caches[1].k)


def test_recomputed_means_cover_a_partial_last_chunk(tiny):
    model = tiny["mha"].model
    full = make_full(model, 64, offloaded=False)
    forward(model, full, random_ids(29, seed=3))  # 3 complete chunks of 8 and 5 rows
    kept, redone = ChunkStats.for_cache(full, 8), ChunkStats.for_cache(full, 8, recompute_resident=True)
    for layer in range(full.n_layers):
        kept.update(layer, full, 29)
        want = kept.means(layer, full, 29, full.k.device)
        assert want.shape[0] == 4 and torch.equal(redone.means(layer, full, 29, full.k.device), want)


# Llama-2-7B at the paper's 122K prompt on an 80 GB card: with float32 statistics for 32 resident layers
# (7.5 GiB) the whole cache does not fit 78 GiB; without them it does.
def test_the_planner_drops_resident_statistics_before_it_offloads_a_layer():
    target, draft = shapes("llama2-7b")
    for offload in ("off", "auto"):
        p = placement.plan(target, work(122880), offload, 78 * GiB, 1024 * GiB, draft)
        assert (p.resident, p.recompute_stats) == (32, True) and p.peak <= 78 * GiB
        kept = placement.layout(target, work(122880), 32, draft, budget=78 * GiB)
        assert kept.peak > 78 * GiB and not kept.recompute_stats
        # one scratch layer of means instead of 32 kept layers of sums beside it
        assert p.item("retrieval chunk statistics") * 33 == kept.item("retrieval chunk statistics")
    half = placement.plan(target, work(65536), "off", 78 * GiB, 1024 * GiB, draft)
    assert (half.resident, half.recompute_stats) == (32, False)


def test_statistics_are_not_dropped_where_they_cannot_help():
    target, draft = shapes("llama2-7b")
    ar = dataclasses.replace(work(122880), spec=Speculation(method="ar"))
    assert not placement.plan(target, ar, "off", 78 * GiB, 1024 * GiB, draft).recompute_stats
    on = placement.plan(target, work(122880), "on", 24 * GiB, 1024 * GiB, draft)  # nothing resident
    assert (on.resident, on.recompute_stats) == (0, False)
    with pytest.raises(TforceError, match="not enough GPU memory"):
        placement.plan(target, work(122880), "off", 70 * GiB, 1024 * GiB, draft)


def recompute_everything(monkeypatch, module):
    """module.plan_session's plans, with recompute_stats forced on; the ChunkStats made, recorded."""
    made, plan, for_cache = [], module.plan_session, ChunkStats.__init__

    def init(self, homes, *a, **k):
        made.append(homes)
        for_cache(self, homes, *a, **k)

    monkeypatch.setattr(module, "plan_session", lambda *a: dataclasses.replace(plan(*a), recompute_stats=True))
    monkeypatch.setattr(ChunkStats, "__init__", init)
    return made


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_with_recomputed_statistics_is_the_kept_one(tiny, monkeypatch, temperature):
    """Greedy: plain decoding's tokens; seeded sampling: the same draws as with kept statistics (the
    selection is bit-identical, so every acceptance test sees the same numbers)."""
    prompt = random_ids(70, seed=7)[0].tolist()
    kw = dict(max_new_tokens=40, temperature=temperature, seed=11, ignore_eos=True)
    spec = dict(draft=tiny["draft"], method="triforce", budget=16, chunk_size=4, rebuild_every=8, **kw)
    kept = tforce.generate(tiny["gqa"], prompt, **spec)
    made = recompute_everything(monkeypatch, tforce.engine.nodes)
    redone = tforce.generate(tiny["gqa"], prompt, **spec)
    assert made and all(home is None for homes in made for home in homes)
    assert redone.tokens == kept.tokens and redone.stats["acceptance"] == kept.stats["acceptance"]
    assert redone.stats["rebuilds"] >= 4
    if temperature == 0:
        assert redone.tokens == tforce.generate(tiny["gqa"], prompt, method="ar", **kw).tokens


def test_batch_rows_with_recomputed_statistics_equal_plain_decoding(tiny, monkeypatch):
    prompts = [random_ids(n, seed=n)[0].tolist() for n in (30, 45, 12)]
    kw = dict(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    made = recompute_everything(monkeypatch, tforce.engine.nodes)
    rows = tforce.generate_batch(tiny["gqa"], prompts, draft=tiny["draft"], method="triforce", budget=16,
                                 chunk_size=4, draft_budget=12, sinks=2, **kw)
    assert len(made) == 3 and all(home is None for homes in made for home in homes)
    for prompt, row in zip(prompts, rows):
        assert row.tokens == tforce.generate(tiny["gqa"], prompt, method="ar", **kw).tokens


def test_the_plan_counts_the_means_scratch_every_rebuild_allocates(tiny):
    """ChunkStats.means allocates one layer's float32 means on the device at every rebuild, kept statistics
    or not, and chunk_positions holds every layer's scores before it selects: the planner counts both
    (it counted no scratch for an all-resident plan with kept statistics, and one layer of scores)."""
    model = tiny["mha"].model
    full = make_full(model, 64, offloaded=False)
    forward(model, full, random_ids(64, seed=3))
    kept = ChunkStats.for_cache(full, 8)
    kept.update(0, full, 64)
    means = kept.means(0, full, 64, full.k.device)
    assert means.data_ptr() != kept.sums[0].data_ptr()  # a fresh layer of means beside the kept sums

    target, draft = shapes("llama2-7b")
    w = work(65536)
    layer_stats = placement.chunk_stat_bytes(w.capacity, w.spec.chunk_size, target.kv_heads, target.head_dim)
    scores = target.layers * target.kv_heads * placement.n_chunks(w.capacity, w.spec.chunk_size) * 4
    for recompute, kept_layers in ((False, 32), (True, 0)):
        p = placement.layout(target, w, 32, draft, recompute_stats=recompute)
        assert p.item("retrieval chunk statistics") == (kept_layers + 1) * layer_stats
        assert p.item("rebuild scratch") >= scores
    # rows keep their own statistics but are rebuilt one after another: one scratch layer, not one per row
    rows = dataclasses.replace(w, rows=3)
    p = placement.layout(target, rows, 20, draft)
    assert p.item("retrieval chunk statistics") == (3 * 20 + 1) * layer_stats
