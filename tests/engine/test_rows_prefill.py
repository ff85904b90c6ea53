"""The batch's layer-major prefill (prefill.py, prefill_layer_major): bit for bit the token-major
prefill of Node.prefill (same chunks, same matmul shapes: float32 on the CPU, no tolerance), the per-row
retrieval statistics taken on the device, and PCIe traffic linear in the prompts."""
from __future__ import annotations

import pytest
import torch

import tforce.engine.session
from model_helpers import prompts_of, rotary_for
from tforce.engine.batch import generate_batch
from tforce.engine.node import Node
from tforce.cache import FullCache, RetrievalCache
from tforce.cache.offload import OffloadedCache
from tforce.config import Sampling, Speculation
from tforce.engine.prefill import prefill_layer_major

HEADS = (12, 0, 36, 4, 1)  # prompts but their last token: an empty one (a 1-token prompt), one of one token
CHUNK = 8


def make(model, rows: int, resident: int | None, capacity: int = 64):
    n_layers, n_kv, d = model.config.num_hidden_layers, model.n_kv_heads, model.head_dim
    if resident is None:
        return FullCache(n_layers, n_kv, d, capacity, rotary_for(model), rows=rows)
    return OffloadedCache(n_layers, n_kv, d, capacity, rotary_for(model), resident=resident, rows=rows)


def token_major(model, seqs, resident=None, capacity=64):
    node = Node("full", model, make(model, len(seqs), resident, capacity), Sampling(), capacity, CHUNK)
    buf = torch.zeros(len(seqs), capacity, dtype=torch.long)
    for b, s in enumerate(seqs):
        buf[b, :len(s)] = torch.tensor(s, dtype=torch.long)
    node.prefill(buf, [len(s) for s in seqs])
    return node.cache


def layer_kv(cache, layer: int):
    """One layer's K, V (B, S, H_kv, D) wherever they live."""
    if layer >= getattr(cache, "resident", cache.n_layers):
        h = layer - cache.resident
        return cache.host_k[h], cache.host_v[h]
    return cache.k[layer], cache.v[layer]


@pytest.mark.parametrize("resident", [None, 0, 1])
def test_rows_layer_major_prefill_is_bit_identical_to_token_major(tiny, resident):
    model = tiny["gqa"].model
    seqs = prompts_of(HEADS)
    want = token_major(model, seqs)
    got = make(model, len(seqs), resident)
    seen = []
    prefill_layer_major(model, seqs, got, CHUNK, progress=lambda d, t: seen.append((d, t)))
    total = model.config.num_hidden_layers * sum(HEADS)
    assert got.lengths == want.lengths == list(HEADS) and seen[-1] == (total, total)
    for layer in range(model.config.num_hidden_layers):
        (gk, gv), (wk, wv) = layer_kv(got, layer), layer_kv(want, layer)
        for b, n in enumerate(HEADS):
            assert torch.equal(gk[b, :n], wk[b, :n]) and torch.equal(gv[b, :n], wv[b, :n])
    for b, n in enumerate(HEADS):
        if n == 0:
            assert got.row_queries[b] is None and want.row_queries[b] is None
            continue
        assert got.row_queries[b][0] == want.row_queries[b][0]  # the last chunk's first position
        for g, w in zip(got.query_at(b, n - 1), want.query_at(b, n - 1)):
            assert torch.equal(g, w)
    nxt = torch.tensor([[5], [6], [7], [8], [9]])  # every row's next token, one forward
    logits = []
    for cache in (want, got):
        cache.begin(1)
        logits.append(model(nxt, cache))
    assert torch.equal(*logits)


@pytest.mark.parametrize("resident", [0, 1])
def test_rows_retrieval_statistics_are_taken_during_the_prefill(tiny, resident):
    """The first rebuild after the prefill reads no host keys for statistics: per offloaded layer and row,
    only its partial last chunk and its selected rows; and it selects exactly what a rebuild from scratch
    (reading every row's keys) selects."""
    model = tiny["gqa"].model
    n_layers, n_kv, d = model.config.num_hidden_layers, model.n_kv_heads, model.head_dim
    budget, chunk = 16, 4
    seqs = prompts_of((37, 5, 23, 1), seed=1)
    counts = [len(s) for s in seqs]

    def retrieval(full):
        return RetrievalCache(n_layers, n_kv, d, budget, chunk, full.rotary, rows=len(seqs))

    def rebuild(cache, full):
        rows = list(range(len(seqs)))
        cache.rebuild(full, rows, [full.query_at(b, n - 1) for b, n in enumerate(counts)])

    full = make(model, len(seqs), resident)
    cache = retrieval(full)
    prefill_layer_major(model, seqs, full, CHUNK, on_layer=lambda i, k: cache.observe(full, i, k, counts))
    assert [s.chunks for s in cache.stats] == [[n // chunk] * n_layers for n in counts]
    full.host_rows_read = 0
    rebuild(cache, full)
    partial_and_selected = sum(n % chunk + min(n, budget) for n in counts)
    assert full.host_rows_read == (n_layers - resident) * partial_and_selected
    ref_full = token_major(model, seqs)
    ref = retrieval(ref_full)
    rebuild(ref, ref_full)
    assert torch.equal(cache.key_pos, ref.key_pos) and torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
    for mine, theirs in zip(cache.stats, ref.stats):
        assert all(torch.equal(a, b) for a, b in zip(mine.sums, theirs.sums))


def test_rows_prefill_traffic_is_linear_not_quadratic(tiny):
    """Every layer offloaded, rows of n and n/2 tokens: token-major prefill streams every row's prefix back
    at every chunk (doubling n ~quadruples it); layer-major streams nothing back and writes each row's rows
    once (doubling n doubles them)."""
    model = tiny["gqa"].model
    layers = model.config.num_hidden_layers
    traffic = {}
    for n in (48, 96):
        seqs = prompts_of((n, n // 2), seed=2)
        tm = token_major(model, seqs, resident=0, capacity=128)
        lm = make(model, 2, 0, capacity=128)
        prefill_layer_major(model, seqs, lm, CHUNK)
        traffic[n] = (tm.host_rows_streamed, lm.host_rows_streamed, lm.host_rows_written)
        assert lm.host_rows_written == layers * (n + n // 2)
    (tm48, lm48, w48), (tm96, lm96, w96) = traffic[48], traffic[96]
    assert lm48 == lm96 == 0 and w96 == 2 * w48
    assert tm96 > 3.5 * tm48


def test_generate_batch_prefill_traffic_is_linear(tiny, monkeypatch):
    """generate_batch, triforce with every layer offloaded, prompts of n and 2n tokens and one new token:
    host -> device rows (the prefill's rebuild and the one verification's streaming) double, no more."""
    caches = []

    class Counted(OffloadedCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            caches.append(self)

    monkeypatch.setattr(tforce.engine.nodes, "OffloadedCache", Counted)
    h2d = []
    for n in (40, 80):
        generate_batch(tiny["gqa"], prompts_of((n, n // 2 + 1, 1), seed=3), draft=tiny["draft"], method="triforce",
                       offload="on", max_new_tokens=1, temperature=0, ignore_eos=True, prefill_chunk=CHUNK)
        h2d.append(caches[-1].host_rows_streamed + caches[-1].host_rows_read)
    assert 0 < h2d[0] and h2d[1] <= 2 * h2d[0]


@pytest.mark.parametrize("resident", [0, 1])
def test_the_plan_counts_the_rows_prefill_hidden_states(tiny, resident):
    """Offloaded: the batch's prefill allocates every row's hidden states (the K/V scratch is a staging
    slot), which placement.py counts for B rows."""
    from tforce.engine import placement
    from tforce.engine.session_plan import model_shape

    model = tiny["gqa"].model
    seqs = prompts_of(HEADS)
    N = max(HEADS)
    work = placement.Work(capacity=64, prompt=N, attention="math", rows=len(seqs), cuda_graphs=False, spec=Speculation(method="ar"))
    plan = placement.layout(model_shape(model), work, resident, None, 0)
    allocated = prefill_layer_major(model, seqs, make(model, len(seqs), resident), CHUNK).allocated
    assert allocated == plan.item("prefill hidden states") + plan.item("prefill K/V scratch (a staging slot)")
    assert allocated == len(seqs) * N * model.config.hidden_size * 4
