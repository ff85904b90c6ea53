"""Middle-cache selection rules (cache/policies.py): each cache holds exactly what its rule selects,
checked against brute force in plain loops; and any rule keeps greedy output equal to plain decoding."""
from __future__ import annotations

import math

import pytest
import torch

import tforce
from model_helpers import forward, full_cache, random_ids
from tforce.cache import RetrievalCache
from tforce.cache.policies import H2O, Streaming, TopK, make_select


def build(model, full, budget, select):
    cfg = model.config
    cache = RetrievalCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, budget, 4, full.rotary,
                           select=select)
    cache.rebuild(full, [0], [full.query_at(0, full.length - 1)])
    return cache


def held(cache, layer, head):
    return {p for p in cache.key_pos[layer, 0, head].tolist() if p >= 0}


def check_contents(cache, full):
    for layer in range(cache.k.shape[0]):
        for h in range(cache.k.shape[3]):
            for slot, p in enumerate(cache.key_pos[layer, 0, h].tolist()):
                if p >= 0:
                    assert torch.equal(cache.k[layer, 0, slot, h], full.k[layer, 0, p, h])
                    assert torch.equal(cache.v[layer, 0, slot, h], full.v[layer, 0, p, h])


def brute_attention(keys, length, query, n_kv):
    """Plain loops: per KV head, per key, the softmax probability summed over the group's query heads."""
    n_q, d = query.shape
    group = n_q // n_kv
    out = []
    for h in range(n_kv):
        total = [0.0] * length
        for g in range(group):
            q = query[h * group + g].double().tolist()
            logits = [sum(a * b for a, b in zip(q, keys[s, h].double().tolist())) / math.sqrt(d)
                      for s in range(length)]
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            z = sum(e)
            for s in range(length):
                total[s] += e[s] / z
        out.append(total)
    return out


def top_set(scores, k):
    order = sorted(range(len(scores)), key=lambda s: -scores[s])
    assert scores[order[k - 1]] - scores[order[k]] > 1e-6, "tie at the budget boundary: pick another seed"
    return set(order[:k])


@pytest.mark.parametrize("name,length,budget", [("gqa", 40, 12), ("mha", 33, 10), ("llama3", 30, 7)])
def test_topk_holds_the_brute_force_top_attention(tiny, name, length, budget):
    model = tiny[name].model
    full = full_cache(model, 64)
    forward(model, full, random_ids(length, seed=length))
    cache = build(model, full, budget, TopK())
    for layer in range(model.config.num_hidden_layers):
        query = full.query_at(0, length - 1)[layer]
        scores = brute_attention(full.k[layer, 0], length, query, model.n_kv_heads)
        for h in range(model.n_kv_heads):
            assert held(cache, layer, h) == top_set(scores[h], budget), (layer, h)
    check_contents(cache, full)


def test_streaming_holds_sinks_and_recent_window(tiny):
    model = tiny["gqa"].model
    full = full_cache(model, 64)
    forward(model, full, random_ids(50, seed=3))
    cache = build(model, full, 16, Streaming(sinks=4))
    for layer in range(model.config.num_hidden_layers):
        for h in range(model.n_kv_heads):
            assert held(cache, layer, h) == set(range(4)) | set(range(38, 50))
            # newest first in the budget's slots (the spill slot after them holds nothing)
            assert cache.key_pos[layer, 0, h].tolist()[4:] == list(range(49, 37, -1)) + [-1]
    check_contents(cache, full)


def brute_accumulated(model, ids):
    """Queries recorded one token at a time, then plain-loop attention summed over all (causal) queries."""
    n = ids.shape[1]
    full = full_cache(model, n)
    queries = [[] for _ in range(model.config.num_hidden_layers)]
    for t in range(n):
        forward(model, full, ids[:, t:t + 1])
        for layer in range(len(queries)):
            queries[layer].append(full.query_at(0, t)[layer])
    n_kv = model.n_kv_heads
    out = []
    for layer in range(len(queries)):
        acc = [[0.0] * n for _ in range(n_kv)]
        for t in range(n):
            probs = brute_attention(full.k[layer, 0], t + 1, queries[layer][t], n_kv)
            for h in range(n_kv):
                for s in range(t + 1):
                    acc[h][s] += probs[h][s]
        out.append(acc)
    return out, full


@pytest.mark.parametrize("name", ["gqa", "llama3"])
def test_h2o_holds_heavy_hitters_and_recent_window(tiny, name):
    model = tiny[name].model
    n, budget = 36, 12
    ids = random_ids(n, seed=7)
    acc, full = brute_accumulated(model, ids)
    select = H2O()
    select.prepare(model, ids[0], chunk=16)  # chunks: the result must not depend on them
    for layer in range(len(acc)):
        for h in range(model.n_kv_heads):
            got = select.scores[0][layer][h].double()
            assert torch.allclose(got, torch.tensor(acc[layer][h], dtype=torch.float64), atol=1e-4)
    cache = build(model, full, budget, select)
    n_recent = budget // 2
    for layer in range(len(acc)):
        for h in range(model.n_kv_heads):
            heavy = top_set(acc[layer][h][:n - n_recent], budget - n_recent)
            assert held(cache, layer, h) == heavy | set(range(n - n_recent, n)), (layer, h)
    check_contents(cache, full)


@pytest.mark.parametrize("policy", ["retrieval", "shared", "topk", "streaming", "h2o"])
@pytest.mark.parametrize("method", ["retrieval", "triforce"])
def test_greedy_with_any_policy_equals_plain_decoding(tiny, policy, method):
    prompt = random_ids(60, seed=11)[0].tolist()
    kw = dict(max_new_tokens=24, temperature=0, ignore_eos=True)
    ar = tforce.generate(tiny["gqa"], prompt, method="ar", **kw).tokens
    out = tforce.generate(tiny["gqa"], prompt, draft=tiny["draft"], method=method, policy=policy, budget=16,
                          chunk_size=4, sinks=4, draft_budget=16, rebuild_every=8, **kw)
    assert out.tokens == ar
    assert out.stats["acceptance"]["retrieval"] is not None


def test_unknown_policy_is_a_usage_error(tiny):
    with pytest.raises(tforce.errors.UsageError):
        tforce.generate(tiny["gqa"], [1, 2, 3], method="retrieval", policy="nope", max_new_tokens=2)
    with pytest.raises(ValueError):
        make_select("nope")


def test_h2o_accumulated_attention_is_the_causal_attention_summed_over_queries():
    """accumulated_attention (blocks of queries, each against only the keys it can see) equals the
    attention matrix computed whole, causally masked, summed over queries and each group's heads."""
    from tforce.cache.policies import accumulated_attention

    g = torch.Generator().manual_seed(0)
    L, n_kv, G, d = 70, 2, 3, 8
    keys, queries = torch.randn(L, n_kv, d, generator=g), torch.randn(L, n_kv * G, d, generator=g)
    logits = torch.einsum("thgd,lhd->hgtl", queries.view(L, n_kv, G, d), keys) / math.sqrt(d)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    want = logits.masked_fill(~causal, float("-inf")).softmax(-1).sum((1, 2))
    for block in (1, 16, 70, 256):
        torch.testing.assert_close(accumulated_attention(keys, queries, block=block), want)
