"""RetrievalCache of B rows (cache/retrieval.py): the batched middle cache against FullCache of B rows and against a
single-row RetrievalCache rebuilt on each row alone; the offloaded full cache gives the same rebuild."""
from __future__ import annotations

import pytest
import torch

from model_helpers import full_cache, rotary_for
from tforce.cache import FullCache, RetrievalCache
from tforce.cache.policies import make_select
from tforce.cache.offload import OffloadedCache
from tforce.errors import TforceError

LENGTHS = (37, 5, 23, 1)  # rows of different lengths, one of one token, one a partial last chunk


def rows_ids(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]


def feed(model, cache, rows: list[list[int]]) -> torch.Tensor:
    """Row b's tokens rows[b] after what it holds, padded at the end; logits (B, T, V)."""
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    cache.begin(T)
    logits = model(ids, cache, last_n=None)
    cache.commit(torch.tensor([len(r) for r in rows]))
    return logits


def dims(model):
    return model.config.num_hidden_layers, model.n_kv_heads, model.head_dim


def filled(model, lengths, cls=FullCache, **kw):
    n_layers, n_kv, d = dims(model)
    full = cls(n_layers, n_kv, d, 128, rotary_for(model), rows=len(lengths), **kw)
    ids = rows_ids(lengths)
    for start in range(0, max(lengths), 16):  # in chunks: short rows see forwards of only padding
        feed(model, full, [r[start:start + 16] for r in ids])
    return full


def rebuilt(model, full, budget, chunk, shared=False):
    n_layers, n_kv, d = dims(model)
    cache = RetrievalCache(n_layers, n_kv, d, budget, chunk, full.rotary, shared=shared, rows=full.rows)
    rows = list(range(full.rows))
    cache.rebuild(full, rows, [full.query_at(b, int(full.lengths[b]) - 1) for b in rows])
    return cache


def test_budget_over_every_row_gives_the_full_cache_logits(tiny):
    model = tiny["gqa"].model
    full = filled(model, LENGTHS)
    retrieval = rebuilt(model, full, budget=64, chunk=4)
    new = rows_ids((3, 1, 2, 3), seed=1)  # rows of different lengths fed different counts
    got, want = feed(model, retrieval, new), feed(model, full, new)
    for b, r in enumerate(new):
        torch.testing.assert_close(got[b, :len(r)], want[b, :len(r)], rtol=1e-5, atol=1e-5)
    assert retrieval.lengths == full.lengths


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("name", ["gqa", "llama3"])
def test_each_row_selects_what_a_single_cache_selects_on_it_alone(tiny, name, shared):
    model = tiny[name].model
    full = filled(model, LENGTHS)
    budget, chunk = 16, 4  # drops chunks of the long rows, keeps the short rows whole
    batched = rebuilt(model, full, budget, chunk, shared=shared)
    n_layers, n_kv, d = dims(model)
    for b, L in enumerate(LENGTHS):
        one = full_cache(model, 128, full.rotary)
        one.k[:, 0, :L], one.v[:, 0, :L] = full.k[:, b, :L], full.v[:, b, :L]
        one.lengths[0] = L
        single = RetrievalCache(n_layers, n_kv, d, budget, chunk, full.rotary, shared=shared)
        single.rebuild(one, [0], [full.query_at(b, L - 1)])
        assert torch.equal(batched.key_pos[:, b], single.key_pos[:, 0])
        assert torch.equal(batched.k[:, b], single.k[:, 0]) and torch.equal(batched.v[:, b], single.v[:, 0])
    assert (batched.key_pos[:, 0] >= 0).sum(-1).max() == budget  # the longest row really dropped tokens


@pytest.mark.parametrize("policy", ["topk", "streaming"])
@pytest.mark.parametrize("resident", [None, 1])
def test_a_select_rule_picks_per_row_what_a_single_cache_picks_on_it_alone(tiny, policy, resident):
    """policies.py's rules, asked per row and layer: with the full cache resident or an offloaded layer
    (scored in host memory), each row holds what a single RetrievalCache with that rule holds for it."""
    model = tiny["gqa"].model
    full = filled(model, LENGTHS) if resident is None else filled(model, LENGTHS, OffloadedCache, resident=1)
    ref = filled(model, LENGTHS)  # the same K/V, resident, to copy into single caches
    budget, chunk = 16, 4
    n_layers, n_kv, d = dims(model)
    batched = RetrievalCache(n_layers, n_kv, d, budget, chunk, full.rotary, select=make_select(policy, sinks=2),
                             rows=full.rows)
    rows = list(range(full.rows))
    batched.rebuild(full, rows, [full.query_at(b, L - 1) for b, L in enumerate(LENGTHS)])
    for b, L in enumerate(LENGTHS):
        one = full_cache(model, 128, full.rotary)
        one.k[:, 0, :L], one.v[:, 0, :L] = ref.k[:, b, :L], ref.v[:, b, :L]
        one.lengths[0] = L
        single = RetrievalCache(n_layers, n_kv, d, budget, chunk, full.rotary, select=make_select(policy, sinks=2))
        single.rebuild(one, [0], [full.query_at(b, L - 1)])
        assert torch.equal(batched.key_pos[:, b], single.key_pos[:, 0])
        assert torch.equal(batched.k[:, b], single.k[:, 0]) and torch.equal(batched.v[:, b], single.v[:, 0])
    assert (batched.key_pos[:, 0] >= 0).sum(-1).max() == budget  # the longest row really dropped tokens


def test_a_select_rules_empty_slots_stay_empty(tiny):
    """A rule may answer -1 (an empty slot, policies.py's contract): the row holds nothing there."""
    model = tiny["gqa"].model
    full = filled(model, LENGTHS)
    n_layers, n_kv, d = dims(model)

    def first_and_empty(layer, keys, length, query, budget, row):
        return torch.tensor([[0, -1]] * keys.shape[1])

    cache = RetrievalCache(n_layers, n_kv, d, 16, 4, full.rotary, select=first_and_empty, rows=full.rows)
    cache.rebuild(full, [0], [full.query_at(0, LENGTHS[0] - 1)])
    assert cache.key_pos[:, 0, :, :3].tolist() == [[[0, -1, -1]] * n_kv] * n_layers
    assert torch.equal(cache.k[:, 0, 0], full.k[:, 0, 0])


def test_offloaded_rows_rebuild_bit_for_bit_reading_few_rows(tiny):
    model = tiny["gqa"].model
    resident = filled(model, LENGTHS)
    offloaded = filled(model, LENGTHS, OffloadedCache, resident=1)
    assert torch.equal(offloaded.host_k[0][:, :37], resident.k[1, :, :37])
    a = rebuilt(model, resident, 16, 4)
    offloaded.host_rows_read = 0
    b = rebuilt(model, offloaded, 16, 4)
    assert torch.equal(a.key_pos, b.key_pos) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    # one offloaded layer: every row's complete chunks once (statistics), its partial chunk, its selection
    assert offloaded.host_rows_read <= sum(LENGTHS) + sum(min(L, 16) + 3 for L in LENGTHS)


def test_rebuild_of_listed_rows_only_and_keep(tiny):
    model = tiny["gqa"].model
    full = filled(model, LENGTHS)
    cache = rebuilt(model, full, 16, 4)
    before = cache.key_pos.clone()
    feed(model, full, rows_ids((4, 4, 4, 4), seed=2))
    cache.rebuild(full, [2], [full.query_at(2, int(full.lengths[2]) - 1)])
    assert cache.base == [37, 5, 27, 1] and torch.equal(cache.key_pos[:, [0, 1, 3]], before[:, [0, 1, 3]])
    kept = cache.key_pos[:, [0, 2]].clone()
    cache.keep([0, 2])
    assert cache.rows == 2 and cache.base[:2] == [37, 27] and torch.equal(cache.key_pos[:, :2], kept)


def test_new_tokens_wrap_as_a_single_caches_do(tiny):
    """Past budget - chunk_size new tokens take the first chunk's slots, then wrap (RetrievalCache._slots);
    a forward larger than the budget, whose tokens would share slots, is refused."""
    model = tiny["gqa"].model
    full = filled(model, LENGTHS)
    cache = rebuilt(model, full, 16, 4)
    cache.begin(16)
    base = torch.tensor(cache.base[:4])[:, None] + torch.arange(16)  # (B, 16): every slot holds one new position
    slots = cache.key_pos[:, :4, :, :16]  # the budget's slots (the spill slot after them stays -1)
    assert torch.equal(slots.sort(-1).values, base[None, :, None].expand_as(slots))
    assert (cache.key_pos[..., 16] == -1).all()
    cache.commit(16)
    cache.begin(2)  # wraps onto the newest slots, from the end backwards again
    assert cache.key_pos[0, 0, 0, 15] == cache.base[0] + 16 and cache.key_pos[0, 0, 0, 14] == cache.base[0] + 17
    with pytest.raises(TforceError, match="17 tokens in one forward > its budget 16"):
        cache.begin(17)


def test_offloaded_rows_are_gathered_into_one_reused_host_buffer(tiny):
    """A rebuild's reads of an offloaded layer go through one reused host buffer for K and one for V
    (page-locked on CUDA, so the rows cross by DMA rather than through a pageable bounce: tests/gpu/test_cuda.py),
    each holding exactly the row's selected positions."""
    from tforce.cache.full import gather_heads

    full = filled(tiny["gqa"].model, LENGTHS, OffloadedCache, resident=0)
    idx = torch.tensor([[0, 1], [2, 3], [4, 4]])  # (n, H_kv) positions
    k1, v1 = full.gather_rows(0, idx, row=0)
    k2, v2 = full.gather_rows(1, idx[:2], row=2)
    assert (k1.data_ptr(), v1.data_ptr()) == (k2.data_ptr(), v2.data_ptr())
    assert torch.equal(k2, gather_heads(full.host_k[1][2:3], idx[:2]))
    assert torch.equal(v2, gather_heads(full.host_v[1][2:3], idx[:2]))


def test_h2o_rows_select_by_their_own_prompts_scores(tiny):
    """H2O's heavy hitters come from each row's own prompt (prepare(model, prompt, row)): row b's scores are
    those of H2O prepared on prompt b alone, the long rows' scores and heavy hitters differ, and every row
    holds what a single cache with H2O prepared on its prompt holds. When finished rows are compacted away
    (keep), the rule's scores move with their rows: a moved row selected again still holds what it would
    alone."""
    model = tiny["gqa"].model
    full, ref = filled(model, LENGTHS), filled(model, LENGTHS)
    prompts = [torch.tensor(p) for p in rows_ids(LENGTHS)]  # what `filled` fed each row
    budget, chunk = 16, 4  # rows 0 and 2 (37 and 23 tokens) select; rows 1 and 3 are held whole
    n_layers, n_kv, d = dims(model)
    h2o = make_select("h2o")
    for b, p in enumerate(prompts):
        h2o.prepare(model, p, b)
    batched = RetrievalCache(n_layers, n_kv, d, budget, chunk, full.rotary, select=h2o, rows=full.rows)
    rows = list(range(full.rows))
    batched.rebuild(full, rows, [full.query_at(b, L - 1) for b, L in enumerate(LENGTHS)])
    singles = []
    for b, L in enumerate(LENGTHS):
        alone = make_select("h2o")
        alone.prepare(model, prompts[b])
        assert all(torch.equal(a, s) for a, s in zip(alone.scores[0], h2o.scores[b]))
        one = full_cache(model, 128, full.rotary)
        one.k[:, 0, :L], one.v[:, 0, :L] = ref.k[:, b, :L], ref.v[:, b, :L]
        one.lengths[0] = L
        single = RetrievalCache(n_layers, n_kv, d, budget, chunk, full.rotary, select=alone)
        single.rebuild(one, [0], [full.query_at(b, L - 1)])
        assert torch.equal(batched.key_pos[:, b], single.key_pos[:, 0]), b
        assert torch.equal(batched.k[:, b], single.k[:, 0]) and torch.equal(batched.v[:, b], single.v[:, 0])
        singles.append(single)
    n_recent = budget // 2  # the rest of a selecting row's slots are its heavy hitters
    heavy = [batched.key_pos[:, b, :, :budget - n_recent] for b in (0, 2)]
    assert not torch.equal(heavy[0], heavy[1])  # two prompts, two selections
    assert not torch.equal(h2o.scores[0][0][:, :LENGTHS[2]], h2o.scores[2][0])
    # rows 0 and 1 finish: rows 2 and 3 move to the front and row 2 (now 0) is selected again
    full.keep([2, 3])
    batched.keep([2, 3])
    batched.rebuild(full, [0], [full.query_at(0, LENGTHS[2] - 1)])
    assert torch.equal(batched.key_pos[:, 0], singles[2].key_pos[:, 0])
    assert torch.equal(batched.k[:, 0], singles[2].k[:, 0])
