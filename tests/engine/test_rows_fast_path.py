"""One class per cache kind, rows as a dimension (docs/architecture.md, Rows): rows of one length take the
fast path (one block written for all rows, a contiguous causal view, no mask for one new token, fixed
shapes that CUDA graphs may replay), rows of different lengths a per-row mask; either way each row's
logits are those of a one-row cache fed that row alone."""
from __future__ import annotations

import pytest
import torch

from model_helpers import forward, random_ids, rotary_for
from tforce.cache import FullCache, RetrievalCache, StreamingCache
from tforce.cache.offload import OffloadedCache


def dims(model):
    return model.config.num_hidden_layers, model.n_kv_heads, model.head_dim


def make(model, kind: str, rows: int):
    rotary = rotary_for(model, 128)
    if kind == "full":
        return FullCache(*dims(model), 128, rotary, rows=rows)
    if kind == "offloaded":
        return OffloadedCache(*dims(model), 128, rotary, resident=1, rows=rows)
    return StreamingCache(*dims(model), budget=12, sinks=2, rotary=rotary, max_rollback=8, max_new=32, rows=rows)


def one_view(model, cache, T: int):
    """The view layer 0 of a forward of T new tokens gets (random q, k, v; nothing committed)."""
    g = torch.Generator().manual_seed(T)
    n_kv, d = model.n_kv_heads, model.head_dim
    q = torch.randn(cache.rows, T, model.config.num_attention_heads, d, generator=g)
    k, v = torch.randn(cache.rows, T, n_kv, d, generator=g), torch.randn(cache.rows, T, n_kv, d, generator=g)
    cache.begin(T)
    _, view = cache.update(0, q, k, v)
    cache.commit(0)
    return view


@pytest.mark.parametrize("kind", ["full", "offloaded", "streaming"])
def test_rows_of_one_length_share_a_causal_view_and_ragged_rows_get_masks(tiny, kind):
    model = tiny["gqa"].model
    cache = make(model, kind, 3)
    ids = torch.cat([random_ids(20, seed=s) for s in range(3)])  # (3, 20)
    cache.begin(20)
    model(ids, cache, last_n=0)
    cache.commit(20)
    for T in (1, 3):
        view = one_view(model, cache, T)
        assert view.causal and (view.mask is None) == (T == 1)
    if kind == "streaming":  # the window is full: fixed shapes, keyed by the row count
        cache.begin(1)
        assert cache.graph_key() == ("streaming", 12 + 1, 3)
        cache.commit(0)
    cache.truncate(torch.tensor([20, 18, 19]))
    view = one_view(model, cache, 2)
    assert not view.causal and view.mask.shape[:3] == (3, 1, 2)
    if kind == "streaming":
        cache.begin(1)
        assert cache.graph_key() is None
        cache.commit(0)


@pytest.mark.parametrize("kind", ["full", "offloaded", "streaming"])
@pytest.mark.parametrize("ragged", [False, True])
def test_each_row_equals_a_one_row_cache_fed_it_alone(tiny, kind, ragged):
    model = tiny["gqa"].model
    lengths = [23, 9, 17] if ragged else [23, 23, 23]
    seqs = [random_ids(n + 4, seed=10 + b) for b, n in enumerate(lengths)]
    batch = make(model, kind, 3)
    N = max(lengths)
    ids = torch.zeros(3, N, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = seqs[b][0, :n]
    batch.begin(N)
    model(ids, batch, last_n=0)
    batch.commit(torch.tensor(lengths))
    nxt = torch.cat([s[:, -4:] for s in seqs])  # (3, 4): every row's next four tokens
    batch.begin(4)
    got = model(nxt, batch, last_n=None)
    batch.commit(4)
    for b, n in enumerate(lengths):
        alone = make(model, kind, 1)
        forward(model, alone, seqs[b][:, :n])
        want = forward(model, alone, seqs[b][:, n:])
        torch.testing.assert_close(got[b], want[0], rtol=1e-5, atol=1e-5)


def test_retrieval_rows_of_one_length_share_their_slots(tiny):
    """Rows rebuilt at one length share one slot table (graph_key set); a row rebuilt alone breaks that."""
    model = tiny["gqa"].model
    full = make(model, "full", 2)
    ids = torch.cat([random_ids(30, seed=s) for s in range(2)])
    full.begin(30)
    model(ids, full, last_n=0)
    full.commit(30)
    cache = RetrievalCache(*dims(model), 16, 4, full.rotary, rows=2)
    cache.rebuild(full, [0, 1], [full.query_at(b, 29) for b in range(2)])
    cache.begin(2)
    assert cache.graph_key() == ("retrieval", 2)
    cache.commit(2)
    full.begin(1)
    model(torch.tensor([[5], [6]]), full, last_n=0)
    full.commit(1)
    cache.rebuild(full, [1], [full.query_at(1, 30)])  # row 1's base moves on, row 0's stays
    cache.truncate(torch.tensor([31, 31]))
    cache.begin(1)
    assert cache.graph_key() is None
    cache.commit(1)
