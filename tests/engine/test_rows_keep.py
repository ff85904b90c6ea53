"""keep() of the batched caches (cache/rows.py): finished rows leave, the live ones
move to the front with what they hold, and the move needs no scratch memory. It gathered every kept
row's whole capacity into a temporary first (one layer's kept rows: up to a full layer of the batch's
KV, on the device for resident layers), which placement.py does not plan, so a batch planned to fill
the GPU could run out of memory when its first row finished."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from model_helpers import rotary_for
from tforce.cache import FullCache, StreamingCache
from tforce.cache.offload import OffloadedCache

LENGTHS = [10, 20, 30, 40]
KEEP = [1, 3]


def largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation any operator made while fn ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def caches(model):
    dims = (model.config.num_hidden_layers, len(LENGTHS), model.n_kv_heads, model.head_dim)
    rotary = rotary_for(model)
    one = (dims[0], *dims[2:])  # the one-row caches' dimensions: rows are a keyword
    return {"full": FullCache(*one, 500, rotary, rows=len(LENGTHS)),
            "offloaded": OffloadedCache(*one, 500, rotary, resident=1, rows=len(LENGTHS)),
            "streaming": StreamingCache(*one, budget=300, sinks=4, rotary=rotary, max_rollback=10, max_new=100,
                                        rows=len(LENGTHS))}


def stores(cache) -> list[torch.Tensor]:
    """Every (rows, slots, H_kv, D) store of the cache, per layer."""
    return list(cache.k) + list(cache.v) + getattr(cache, "host_k", []) + getattr(cache, "host_v", [])


@pytest.mark.parametrize("name", ["full", "offloaded", "streaming"])
def test_keep_moves_the_live_rows_without_scratch(tiny, name):
    cache = caches(tiny["gqa"].model)[name]
    g = torch.Generator().manual_seed(0)
    for x in stores(cache):
        x.copy_(torch.randn(x.shape, generator=g))
    cache.lengths[:] = LENGTHS
    if name == "streaming":
        cache.offset[:] = [4, 9, 4, 14]  # rows 1, 3 compacted: position p >= 4 in slot p - 5, p - 10
    used = [int(L) if name != "streaming" else cache._slot(b, int(L)) for b, L in enumerate(cache.lengths)]
    before = [x.clone() for x in stores(cache)]
    row_bytes = stores(cache)[0][0].nbytes  # one row of one layer
    assert largest_allocation(lambda: cache.keep(KEEP)) < row_bytes
    assert cache.rows == 2 and cache.lengths[:2] == [LENGTHS[i] for i in KEEP]
    for x, old in zip(stores(cache), before):
        for j, i in enumerate(KEEP):
            assert torch.equal(x[j, :used[i]], old[i, :used[i]])
    if name == "streaming":
        assert cache.offset[:2] == [9, 14]


@pytest.mark.cuda
def test_keep_allocates_nothing_on_the_device():
    """The same on CUDA, measured by the caching allocator (untested here: no GPU on the machine that wrote it)."""
    from tforce.cache import FullCache

    class _Rotary:  # keep() never rotates
        pass

    cache = FullCache(2, 2, 16, 4096, _Rotary(), device="cuda", rows=len(LENGTHS))
    cache.lengths[:] = LENGTHS
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    cache.keep(KEEP)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - start < cache.k[0, 0].nbytes


def test_retrieval_keep_moves_rows_without_scratch(tiny):
    """RetrievalCache.keep (of rows) gathered the kept rows' slots and key positions of every layer into
    temporaries (the positions twice: an index copy, then a clone), unplanned: at a 4K budget, 32 rows and
    32 layers, over half a GiB. Each moving row is now copied in place."""
    from tforce.cache import RetrievalCache

    model = tiny["gqa"].model
    cache = RetrievalCache(model.config.num_hidden_layers, model.n_kv_heads, model.head_dim,
                           budget=256, chunk_size=4, rotary=rotary_for(model), rows=len(LENGTHS))
    g = torch.Generator().manual_seed(1)
    for x in (cache.k, cache.v):
        x.copy_(torch.randn(x.shape, generator=g))
    cache.key_pos.copy_(torch.randint(-1, 50, cache.key_pos.shape, generator=g))
    cache.lengths[:], cache.base[:] = LENGTHS, [5, 15, 25, 35]
    cache.stats = ["s0", "s1", "s2", "s3"]  # each row's ChunkStats, moved with it
    before = [x.clone() for x in (cache.k, cache.v, cache.key_pos)]
    assert largest_allocation(lambda: cache.keep(KEEP)) < cache.k[0, 0].nbytes
    budget = (slice(None), slice(None), slice(0, 256))  # the budget's slots (the spill slot holds padding only)
    for x, old in zip((cache.k, cache.v), before):
        assert torch.equal(x[:, :2][budget], old[:, KEEP][budget])
    assert torch.equal(cache.key_pos[:, :2, :, :256], before[2][:, KEEP, :, :256])
    assert cache.rows == 2 and cache.lengths[:2] == [20, 40] and cache.base[:2] == [15, 35]
    assert cache.stats[:2] == ["s1", "s3"] and cache.stats[2:] == [None, None]
