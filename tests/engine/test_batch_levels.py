"""generate_batch with triforce, retrieval and streaming (levels.py, cache/retrieval.py): every
greedy row is plain decoding of its prompt alone, with rows of different lengths, rows that finish early
and at EOS, budgets that really drop tokens and per-row rebuilds that really happen."""
import pytest
import torch

import tforce
from tforce.engine.batch import generate_batch
from tforce.engine.node import Node

from model_helpers import eos_token, prompts_of, record_host

LENGTHS = (1, 13, 70, 45)  # a one-token prompt; two rows longer than the middle budget
BUDGETS = [30, 25, 30, 14]  # rows finish at different rounds, each after a rebuild (rebuild_every)
SMALL = dict(budget=32, chunk_size=4, gamma1=2, gamma2=3, draft_budget=12, sinks=2, prefill_chunk=8,
             rebuild_every=10)
METHODS = ["triforce", "retrieval", "streaming"]


def alone(model, prompt, n, **kw):
    return tforce.generate(model, prompt, method="ar", max_new_tokens=n, temperature=0, **kw).tokens


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("target", ["gqa", "llama3"])
def test_greedy_rows_equal_plain_decoding(tiny, target, method):
    prompts = prompts_of(LENGTHS)
    rows = generate_batch(tiny[target], prompts, draft=tiny["draft"], method=method, max_new_tokens=BUDGETS,
                          temperature=0, ignore_eos=True, **SMALL)
    for prompt, n, row in zip(prompts, BUDGETS, rows):
        assert row.tokens == alone(tiny[target], prompt, n, ignore_eos=True)
    middle = [r.stats["acceptance"]["retrieval"] for r in rows]
    assert any(0 < a < 1 for a in middle), middle  # the middle level's drafts were both kept and rejected
    if method != "streaming":
        assert min(r.stats["rebuilds"] for r in rows[1:]) > 0  # every row with tokens to go was rebuilt
    if method != "retrieval":
        assert all(r.stats["acceptance"]["draft"] is not None for r in rows)


@pytest.mark.parametrize("method, policy", [("triforce", "retrieval"), ("retrieval", "retrieval"),
                                            ("triforce", "topk"), ("retrieval", "topk"),
                                            ("triforce", "streaming"), ("retrieval", "streaming"),
                                            ("triforce", "h2o"), ("retrieval", "h2o")])
def test_rows_accept_and_rebuild_what_they_would_alone(tiny, method, policy):
    """With rebuild_every below the crowded threshold, a row's rebuilds come at the same tokens as alone:
    greedy, its drafts are then fixed, so its acceptance at both levels, rebuilds and verifications equal
    the single-prompt path's (per-row selection by the policy, catch-up and acceptance, checked together);
    its tokens are plain decoding's. h2o: each row selects by its own prompt's scores, which follow it when
    the rows that finish first are compacted away (rows 0 and 1 leave first; rows 2 and 3, whose prompts are
    longer than the budget, move and are selected again)."""
    prompts = prompts_of(LENGTHS, seed=1)
    kw = dict(draft=tiny["draft"], method=method, temperature=0, ignore_eos=True, policy=policy, **SMALL)
    rows = generate_batch(tiny["gqa"], prompts, max_new_tokens=BUDGETS, **kw)
    for prompt, n, row in zip(prompts, BUDGETS, rows):
        one = tforce.generate(tiny["gqa"], prompt, max_new_tokens=n, **kw)
        assert row.tokens == one.tokens == alone(tiny["gqa"], prompt, n, ignore_eos=True)
        for key in ("acceptance", "rebuilds", "verifications", "tokens_per_verification"):
            assert row.stats[key] == one.stats[key], key


@pytest.mark.parametrize("method", ["triforce", "streaming"])
def test_rows_that_have_their_drafts_sit_out_the_rounds_that_follow(tiny, monkeypatch, method):
    """Under triforce the middle level proposes gamma2 tokens in rounds of different yields per row: a row
    that has its gamma2 takes no part in the rounds its neighbours still need (it is not fed, it drafts
    nothing), so each node feeds each row in exactly the forwards that row's prompt alone needs, and the
    caches that run forwards over some of their rows run them without it."""
    fed: dict[tuple[str, str], int] = {}
    in_forward: dict[str, int] = {}
    feed, phase = Node._feed, ["batch"]

    def counting_feed(self, seq, ends, last, prefill=False, want=None, alone=False):
        counts = [e - s for s, e in zip(self.cache.lengths, ends)]
        key = (self.name, phase[0])
        fed[key] = fed.get(key, 0) + sum(c > 0 for c in counts)
        begin = self.cache.begin

        def counting_begin(n, counts=None, rows=None):
            in_forward[self.name] = in_forward.get(self.name, 0) + (len(ends) if rows is None else len(rows))
            return begin(n, counts) if rows is None else begin(n, counts, rows)
        self.cache.begin = counting_begin
        try:
            return feed(self, seq, ends, last, prefill, want, alone)
        finally:
            del self.cache.begin

    monkeypatch.setattr(Node, "_feed", counting_feed)
    prompts = prompts_of(LENGTHS, seed=1)
    kw = dict(draft=tiny["gqa"], method=method, temperature=0, ignore_eos=True, **SMALL)
    rows = generate_batch(tiny["gqa"], prompts, max_new_tokens=BUDGETS, **kw)
    batch_in_forward, phase[0] = dict(in_forward), "alone"
    for prompt, n, row in zip(prompts, BUDGETS, rows):
        assert row.tokens == tforce.generate(tiny["gqa"], prompt, max_new_tokens=n, **kw).tokens
    for name in ("draft", "retrieval" if method == "triforce" else "streaming"):
        assert fed[(name, "batch")] == fed[(name, "alone")], name  # row-forwards: the batch's = the runs alone'
        assert batch_in_forward[name] == fed[(name, "batch")], name  # no row rides along unfed


@pytest.mark.parametrize("method", METHODS + ["ar"])
def test_batch_statistics_with_the_single_paths_names(tiny, method):
    """ms_per_token, prefill_rebuild_s and rebuild_s are the batch's (the same in every row; rebuild
    seconds only with a retrieval cache, within prefill_s and decode_s); tokens_per_verification the row's."""
    prompts = prompts_of(LENGTHS, seed=4)
    rows = generate_batch(tiny["gqa"], prompts, draft=tiny["draft"], method=method, max_new_tokens=BUDGETS,
                          temperature=0, ignore_eos=True, **SMALL)
    s = rows[0].stats
    retrieval = method in ("triforce", "retrieval")
    # over the tokens decoding made: each row's first came from the prefill
    assert s["ms_per_token"] == pytest.approx(1000 * s["decode_s"] / (sum(BUDGETS) - len(BUDGETS)))
    for key in ("ms_per_token", "prefill_rebuild_s", "rebuild_s"):
        assert len({r.stats[key] for r in rows}) == 1, key
    if retrieval:
        assert 0 < s["prefill_rebuild_s"] <= s["prefill_s"] and 0 < s["rebuild_s"] <= s["decode_s"]
    else:
        assert s["prefill_rebuild_s"] is None and s["rebuild_s"] is None
    for n, row in zip(BUDGETS, rows):
        assert row.stats["tokens_per_verification"] == (n - 1) / row.stats["verifications"]  # the rounds' tokens
    assert (max(r.stats["tokens_per_verification"] for r in rows) > 1) == (method != "ar")


@pytest.mark.parametrize("method", METHODS)
def test_a_row_that_stops_at_eos_leaves_the_others_unchanged(tiny, method):
    prompts = prompts_of(LENGTHS, seed=2)
    model = tiny["gqa"].model
    first = alone(model, prompts[2], 8, ignore_eos=True)
    with eos_token(model, first[3]):
        rows = generate_batch(model, prompts, draft=tiny["draft"], method=method, max_new_tokens=20,
                              temperature=0, **SMALL)
        want = [alone(model, p, 20) for p in prompts]
    assert [r.tokens for r in rows] == want
    assert len(rows[2].tokens) <= 4 < 20 == max(len(t) for t in want)  # one finished early, others went on


def test_offloaded_triforce_rows_equal_plain_decoding(tiny):
    """Every full-cache layer in host memory: rebuilds read each row's rows from there."""
    prompts = prompts_of(LENGTHS, seed=3)
    rows = generate_batch(tiny["gqa"], prompts, draft=tiny["draft"], method="triforce", max_new_tokens=BUDGETS,
                          temperature=0, ignore_eos=True, offload="on", **SMALL)
    for prompt, n, row in zip(prompts, BUDGETS, rows):
        assert row.tokens == alone(tiny["gqa"], prompt, n, ignore_eos=True)
    assert max(r.stats["rebuilds"] for r in rows) > 0


def test_a_node_rolls_each_row_back_to_its_longest_matching_prefix(tiny):
    """Node.probs: row 0 drops its last two tokens (they no longer match), row 1 keeps all and feeds
    one more; the distributions equal a fresh cache's fed the same sequences."""
    from tforce.cache import FullCache
    from tforce.config import Sampling
    from model_helpers import rotary_for

    model = tiny["gqa"].model

    def node():
        cfg = model.config
        cache = FullCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, 64, rotary_for(model), rows=2)
        return Node("full", model, cache, Sampling(temperature=0), 64, 8)

    a, b = prompts_of((20, 11), seed=4)
    n = node()
    held = torch.zeros(2, 64, dtype=torch.long)
    held[0, :20], held[1, :11] = torch.tensor(a), torch.tensor(b)
    n.prefill(held, [20, 11])
    seqs = [a[:-2] + [7, 8, 9], b + [5]]
    buf = torch.zeros(2, 64, dtype=torch.long)
    buf[0, :21], buf[1, :12] = torch.tensor(seqs[0]), torch.tensor(seqs[1])
    got, want = n.probs(buf, [21, 12], last=2), node().probs(buf, [21, 12], last=2)
    assert n.cache.lengths == [21, 12] and torch.equal(n.tokens[:, :21][0], buf[0, :21])
    assert torch.equal(n.tokens[1, :12], buf[1, :12])
    torch.testing.assert_close(got, want)


def test_a_row_not_asked_for_is_left_as_it_is(tiny):
    """probs(..., rows=[0]) feeds row 0 only, in a forward over that row (a cache that takes some rows):
    row 1 keeps its length, slots and record even though the sequence changed under what it holds (a
    rejected speculation: it rolls back when it is next asked for), and row 0's distributions are those
    of row 0 alone."""
    from tforce.cache.streaming import StreamingCache
    from tforce.config import Sampling
    from model_helpers import rotary_for

    model = tiny["gqa"].model
    cfg = model.config

    def node(rows):
        cache = StreamingCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, 16, 2, rotary_for(model), 8,
                               16, rows=rows)
        return Node("draft", model, cache, Sampling(temperature=0), 64, 8)

    a, b = prompts_of((20, 11), seed=4)
    buf = torch.zeros(2, 64, dtype=torch.long)
    buf[0, :20], buf[1, :11] = torch.tensor(a), torch.tensor(b)
    two, one = node(2), node(1)
    two.prefill(buf, [20, 11])
    one.prefill(buf[:1], [20])
    k1, v1, record = two.cache.k[:, 1].clone(), two.cache.v[:, 1].clone(), two.tokens[1].clone()
    buf[1, 5] += 1
    buf[0, 20] = buf[1, 20] = 3
    got = two.probs(buf, [21, 12], rows=[0])
    assert got.shape[0] == 1 and two.cache.lengths == [21, 11]
    assert torch.equal(two.cache.k[:, 1], k1) and torch.equal(two.cache.v[:, 1], v1)
    assert torch.equal(two.tokens[1], record)
    torch.testing.assert_close(got, one.probs(buf[:1], [21]))


def test_rebuilds_refeed_a_token_whose_query_is_not_at_hand(tiny, monkeypatch):
    """Every forward of more than one token forgets its queries (the prefill's chunks, the verifications):
    each rebuild then feeds the row's last committed token again for its query, and every row still
    selects, accepts and rebuilds exactly as alone."""
    from tforce.cache import FullCache

    commit = FullCache.commit
    refed = []

    def forgetful(self, counts):
        commit(self, counts)
        counts = torch.as_tensor(counts).expand(self.rows)
        if int(counts.max()) > 1:
            self.row_queries[:self.rows] = [None] * self.rows
        else:
            refed.append(self.rows)

    monkeypatch.setattr(FullCache, "commit", forgetful)
    prompts = prompts_of(LENGTHS, seed=1)
    kw = dict(draft=tiny["draft"], method="retrieval", temperature=0, ignore_eos=True, **SMALL)
    rows = generate_batch(tiny["gqa"], prompts, max_new_tokens=BUDGETS, **kw)
    assert refed  # the one-token re-feeds happened
    monkeypatch.setattr(FullCache, "commit", commit)
    for prompt, n, row in zip(prompts, BUDGETS, rows):
        one = tforce.generate(tiny["gqa"], prompt, max_new_tokens=n, **kw)
        assert row.tokens == one.tokens
        for key in ("acceptance", "rebuilds"):
            assert row.stats[key] == one.stats[key], key


def test_triforce_host_transfers_carry_every_row(tiny, monkeypatch):
    """Each device -> host transfer carries all live rows at once: a drafted token per row (n numbers) or a
    verdict per row (n counts and n next tokens), never one row's alone."""
    calls = record_host(monkeypatch)
    rows = generate_batch(tiny["gqa"], prompts_of((5, 40, 3)), draft=tiny["draft"], method="triforce",
                          max_new_tokens=12, temperature=0, ignore_eos=True, **SMALL)
    # the first tokens from the prefill, then the first middle round: gamma1 = 2 drafted tokens, one verdict
    assert calls[:4] == [3, 3, 3, 6]
    assert set(calls) <= {1, 2, 3, 4, 6}  # n or 2n numbers for the n rows still live
    assert len(rows) == 3 and min(r.stats["verifications"] for r in rows) > 1


@pytest.mark.parametrize("method", ["triforce", "retrieval"])
def test_a_budget_that_leaves_no_room_for_a_round_runs_as_alone(tiny, method):
    """budget == chunk_size (valid for `generate`): after a rebuild every new token takes a slot of the first
    chunk. The single path's RetrievalCache wraps its slots; a batch ran the prefill and then failed ("new
    tokens would overwrite a row's first chunk"). Its rows must be plain decoding, as alone."""
    prompts = prompts_of(LENGTHS, seed=5)
    kw = dict(SMALL, budget=8, chunk_size=8)
    rows = generate_batch(tiny["gqa"], prompts, draft=tiny["draft"], method=method, max_new_tokens=BUDGETS,
                          temperature=0, ignore_eos=True, **kw)
    for prompt, n, row in zip(prompts, BUDGETS, rows):
        assert row.tokens == alone(tiny["gqa"], prompt, n, ignore_eos=True)
