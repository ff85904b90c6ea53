"""Node (levels.py): a node asked for distributions over tokens its cache already holds must feed them
again at their true positions. A middle level that drafted past what the level above took is asked
exactly that; before this was handled, its tokens landed one position late and its acceptance fell,
invisibly to the exactness tests (the full cache still verified every token)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tforce
from model_helpers import full_cache, random_ids
from tforce.cache import RetrievalCache
from tforce.config import RunConfig, Sampling
from tforce.text.demo import demo_prompt
from tforce.engine.node import Node

SAMPLING = Sampling(temperature=1.0, top_p=1.0)
DEMO = Path(__file__).resolve().parents[2] / "models"


def node_over(model, cache):
    return Node("test", model, cache, SAMPLING, capacity=64)


@pytest.mark.parametrize("kind", ["full", "retrieval"])
def test_probs_over_held_tokens_match_a_fresh_node(tiny, kind):
    model = tiny["gqa"].model
    seq = random_ids(40, seed=5)[0]

    def make():
        full = full_cache(model, 64)
        if kind == "full":
            return full
        return RetrievalCache(model.config.num_hidden_layers, model.n_kv_heads, model.head_dim, 64, 8, full.rotary)

    used = node_over(model, make())
    used.probs(seq[None], [30])  # the cache now holds seq[:30]
    got = used.probs(seq[None], [32], last=5)  # distributions after seq[:28], ..., seq[:32]: re-feeds 27..29
    want = node_over(model, make()).probs(seq[None], [32], last=5)
    assert used.cache.length == 32
    torch.testing.assert_close(got, want)


def test_middle_level_with_the_whole_context_is_never_rejected():
    """budget >= context: the middle level computes the full cache's own distribution, so at
    temperature 0 the full cache accepts every middle-level token. The trained demo pair (committed
    under models/): its draft is good enough that the middle level often drafts past what the full
    level takes, which is when the re-feed above matters (random tiny models rarely get there)."""
    target, draft = tforce.load_model(str(DEMO / "demo-target")), tforce.load_model(str(DEMO / "demo-draft"))
    prompt = target.tokenizer.encode(demo_prompt())[-600:]
    out = tforce.generate(target, prompt, draft=draft, method="triforce", max_new_tokens=48, temperature=0,
                          ignore_eos=True, budget=1024)
    assert out.stats["acceptance"]["retrieval"] == 1.0
    assert 0.2 < out.stats["acceptance"]["draft"] < 1.0  # the draft was both accepted and rejected


def test_stats_count_each_levels_forwards_while_decoding(tiny):
    """stats["forwards"]: one draft forward per drafted token (gamma1 per middle-level verification), one
    middle forward per middle verification, one full forward per full verification; prefill not counted (nor
    the first token, which the prefill's last forward gives)."""
    target, draft = tiny["gqa"], tiny["draft"]
    prompt = random_ids(60, seed=3)[0].tolist()
    out = tforce.generate(target, prompt, draft=draft, method="triforce", max_new_tokens=24, temperature=0,
                          ignore_eos=True, gamma1=3, gamma2=5, budget=32, rebuild_every=1000)
    f = out.stats["forwards"]
    assert set(f) == {"draft", "retrieval", "full"}
    assert f["full"] == out.stats["verifications"] > 0
    assert f["retrieval"] >= f["full"] and f["draft"] == 3 * f["retrieval"]
    ar = tforce.generate(target, prompt, method="ar", max_new_tokens=24, temperature=0, ignore_eos=True)
    # the first token comes from the prefill's last forward: 23 decode forwards for 24 tokens
    assert ar.stats["forwards"] == {"full": 23}


def test_retrieval_budget_is_cut_to_what_the_generation_can_hold(tiny):
    """A --budget larger than the context (the default 4096 on a short prompt) becomes whole chunks
    holding every token: the middle level's view no longer spans thousands of empty masked slots, and the
    output is still ar's."""
    from tforce.config import Speculation

    spec = Speculation(method="triforce", budget=4096, chunk_size=8)
    cut = spec.fitted(100)
    assert cut.budget % 8 == 0 and 100 + spec.max_lookahead + 8 <= cut.budget < 100 + spec.max_lookahead + 16
    assert spec.fitted(10_000).budget == 4096  # a context longer than the budget keeps it
    assert Speculation(method="streaming", budget=4096).fitted(100).budget == 4096  # only retrieval caches
    prompt = list(range(3, 40))
    target, draft = (tforce.engine.generate._module(tiny[n]) for n in ("gqa", "draft"))
    session = tforce.engine.generate.open_session(target, draft, len(prompt), 20, RunConfig.of(budget=4096, chunk_size=4))
    assert session.retrieval.budget < 100 and session.retrieval.k.shape[2] == session.retrieval.budget + 1  # + spill
    kw = dict(max_new_tokens=20, temperature=0, ignore_eos=True)
    assert tforce.generate(tiny["gqa"], prompt, draft=tiny["draft"], method="triforce", budget=4096, **kw).tokens == \
        tforce.generate(tiny["gqa"], prompt, method="ar", **kw).tokens
