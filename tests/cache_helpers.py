"""Caches for the retrieval-statistics tests (tests/cache/test_chunkstats.py, tests/engine/test_recompute_stats.py): a
full cache, on the device or offloaded; a retrieval cache over it; the queries a rebuild selects with; and
the commit patterns the tests feed."""
from __future__ import annotations

from tforce.cache import FullCache, RetrievalCache
from tforce.cache.offload import OffloadedCache

from model_helpers import rotary_for


def make_full(model, capacity: int, offloaded: bool, resident: int = 0):
    dims = (model.config.num_hidden_layers, model.n_kv_heads, model.head_dim)
    rotary = rotary_for(model, capacity)
    if offloaded:
        return OffloadedCache(*dims, capacity=capacity, rotary=rotary, resident=resident)
    return FullCache(*dims, capacity=capacity, rotary=rotary)


def retrieval(model, full, budget: int, chunk: int, shared: bool = False) -> RetrievalCache:
    return RetrievalCache(model.config.num_hidden_layers, model.n_kv_heads, model.head_dim, budget, chunk,
                          full.rotary, shared=shared)


def last_queries(full):
    """Per layer, the rotated query (H_q, D) of the last forward's last token (after a rollback, one
    that was rolled back: any query will do for the statistics)."""
    start, count, queries = full.row_queries[0]
    return [q[0, count - 1] for q in queries]


# Commit patterns: (tokens fed, tokens kept) per forward, rebuilding after each; rollbacks truncate.
PATTERNS = {
    "one-by-one": [(45, 45)] + [(1, 1)] * 12,
    "verify-and-reject": [(43, 43), (6, 2), (6, 6), (7, 1), (5, 0), (9, 9)],
    "chunk-aligned": [(40, 40), (8, 8), (16, 16)],
}
