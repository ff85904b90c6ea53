"""LookupLevel (tforce/engine/lookup.py) as the bottom level, built by hand as session.py composes naive's
hierarchy: SpecLevel(LookupLevel(...), full node, gamma). Greedy: plain decoding token for token, one row
and a batch; sampling: the target's exact distribution (chi-square, as tests/engine/test_exactness.py); and the
level's own drafts: their one-hot labels, the chained lookups, the guess without a match, rollback, rows."""
import functools

import numpy as np

import torch

import tforce
import tforce.engine.levels
from tforce.cache import FullCache
from tforce.cache.rope import Rotary
from tforce.config import Sampling
from tforce.engine.levels import SpecLevel
from tforce.engine.node import Node
from tforce.engine.lookup import DECAY, PRIOR, LookupLevel, Record
from tforce.engine.sampling import sample
from tforce.engine.speculative import verify

from exactness_helpers import N_TOKENS, SAMPLES, SAMPLING, check, exact_joint
from lookup_helpers import SELF_SAMPLED

GREEDY = Sampling(temperature=0)
GAMMA = 4
PROMPT = SELF_SAMPLED


def generate(model, prompts, n_new, sampling, gen, gamma=GAMMA, threshold=0.0):
    """Each row's first n_new tokens (the prefill's, then rounds of the rows still short of them), and the
    top level's statistics."""
    # a row that sits a round out is fed gamma + 1 padding tokens past what it holds (node.Node._feed)
    B, capacity, cfg = len(prompts), max(map(len, prompts)) + n_new + 2 * gamma + 2, model.config
    cache = FullCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, capacity, Rotary(cfg, capacity),
                      rows=B)
    full = Node("full", model, cache, sampling, capacity)
    lookup = LookupLevel(cfg.vocab_size, full.device, rows=B, threshold=threshold)
    top = SpecLevel(lookup, full, gamma, list(range(B)), B)
    seq = torch.zeros(B, capacity, dtype=torch.long)
    for b, p in enumerate(prompts):
        seq[b, :len(p)] = torch.tensor(p)
    n = [len(p) for p in prompts]
    _, first = full.prefill_next(seq, n)
    lookup.prefill(seq, n)
    for b, t in enumerate(sample(first, gen, sampling.greedy).tolist()):
        seq[b, n[b]] = t
        n[b] += 1
    while short := [b for b, p in enumerate(prompts) if n[b] - len(p) < n_new]:
        tokens, _ = top.round(seq, n, gen, short)
        for b, t in zip(short, tokens):
            n[b] += len(t)
    return [seq[b, len(p):len(p) + n_new].tolist() for b, p in enumerate(prompts)], top.stats


def ar(loaded, prompt, n_new):
    return tforce.generate(loaded, prompt, method="ar", max_new_tokens=n_new, temperature=0, ignore_eos=True).tokens


def prompts():
    """A prompt that repeats itself, one without a repeated token, a short one, one token."""
    g = torch.Generator().manual_seed(3)
    repeating = torch.randint(3, 259, (16,), generator=g).tolist() * 3
    return [repeating, (torch.randperm(256, generator=g)[:40] + 3).tolist(), [7, 8, 9, 7, 8], [42]]


def test_greedy_equals_plain_decoding(tiny):
    """Per prompt alone. A random model copies nothing from its prompt, but after the repeating one its
    greedy text soon repeats itself too, which the lookup over the generated tokens drafts: accepted."""
    accepted = []
    for prompt in prompts():
        [tokens], stats = generate(tiny["gqa"].model, [prompt], 40, GREEDY, torch.Generator())
        assert tokens == ar(tiny["gqa"], prompt, 40)
        accepted.append(stats.accepted[0])
    assert accepted[0] > 0, accepted


def test_greedy_batch_rows_equal_plain_decoding_and_accept_as_alone(tiny):
    """Rows of different lengths that finish at different rounds (by what each accepts), sitting the later
    rounds out."""
    model, rows = tiny["llama3"].model, prompts()
    budgets = 30
    got, stats = generate(model, rows, budgets, GREEDY, torch.Generator())
    for b, prompt in enumerate(rows):
        assert got[b] == ar(tiny["llama3"], prompt, budgets)
        _, alone = generate(model, [prompt], budgets, GREEDY, torch.Generator())
        assert (stats.accepted[b], stats.drafted[b]) == (alone.accepted[0], alone.drafted[0])


def draw(target, rows, seed, threshold=0.0, drafted_by=None):
    """SAMPLES generations of N_TOKENS per row: per row the sampled tuples, and the acceptance overall;
    drafted_by: a list that gets each generation's number of drafted tokens."""
    gen = torch.Generator().manual_seed(seed)
    samples, accepted, drafted = [[] for _ in rows], 0, 0
    for _ in range(SAMPLES):
        got, stats = generate(target, rows, N_TOKENS, SAMPLING, gen, gamma=3, threshold=threshold)
        for b, tokens in enumerate(got):
            samples[b].append(tuple(tokens))
        accepted, drafted = accepted + sum(stats.accepted), drafted + sum(stats.drafted)
        if drafted_by is not None:
            drafted_by.append(sum(stats.drafted))
    return samples, accepted / drafted


def test_sampling_matches_target_distribution(small_vocab):
    """One row, and a batch of two rows each against its own prompt's distribution; drafts both accepted and
    rejected (else the test would mean nothing)."""
    target, _ = small_vocab
    for rows, seed in [([PROMPT], 1), ([PROMPT, PROMPT[:9]], 2)]:
        samples, acc = draw(target, rows, seed)
        for prompt, got in zip(rows, samples):
            pvals = check(got, exact_joint(target, prompt, N_TOKENS))
            assert min(pvals) > 1e-3, pvals
        assert 0.1 < acc < 0.95, acc


def test_sampling_with_matches_declined_by_their_record_matches_target_distribution(small_vocab):
    """Threshold 0.5: how many tokens a row drafts depends on whether its earlier matches were right, and so
    on its earlier random draws. PROMPT holds 5 of the 6 tokens, so nearly every round has a match to cut.
    Still the exact distribution."""
    target, _ = small_vocab
    drafted = []
    [samples], acc = draw(target, [PROMPT], 3, threshold=0.5, drafted_by=drafted)
    assert min(check(samples, exact_joint(target, PROMPT, N_TOKENS))) > 1e-3
    assert 0.1 < acc < 0.95, acc
    assert len(set(drafted)) > 1, drafted  # the generations drafted different numbers of tokens


def test_wrong_residual_fails_the_same_test(small_vocab, monkeypatch):
    """Resampling a rejected draft from p instead of p without it would favour the guessed token: caught."""
    monkeypatch.setattr(tforce.engine.levels, "verify", functools.partial(verify, residual=lambda p, q: p))
    target, _ = small_vocab
    [samples], _ = draw(target, [PROMPT], seed=1)
    assert min(check(samples, exact_joint(target, PROMPT, N_TOKENS))) < 1e-6


def propose(level, rows_tokens, k, rows=None):
    """level.propose over a buffer holding the given rows, after draft_lengths as SpecLevel.round asks;
    (buffer, drafts, labels)."""
    seq = torch.zeros(len(rows_tokens), 32, dtype=torch.long)
    for b, t in enumerate(rows_tokens):
        seq[b, :len(t)] = torch.tensor(t)
    rows = list(range(len(rows_tokens))) if rows is None else rows
    level.draft_lengths(seq, [len(t) for t in rows_tokens], k, rows)
    tokens, q = level.propose(seq, [len(t) for t in rows_tokens], k, None, rows)
    return seq, tokens, q


def test_drafts_are_written_and_labelled_one_hot():
    """A continuation cut by the end is looked up again after it: a repeated pattern continues."""
    seq, tokens, q = propose(LookupLevel(10, "cpu"), [[1, 2, 3, 4, 1, 2]], 6)
    assert tokens.tolist() == [[3, 4, 1, 2, 3, 4]]
    assert seq[0, 6:12].tolist() == [3, 4, 1, 2, 3, 4]
    assert q.shape == (1, 6, 10)
    assert torch.equal(q, torch.nn.functional.one_hot(tokens, 10).float())


def test_without_a_match_the_last_token_is_guessed_again():
    _, tokens, _ = propose(LookupLevel(10, "cpu"), [[5, 6, 7]], 3)
    assert tokens.tolist() == [[7, 7, 7]]


def test_labels_of_one_proposal_do_not_leak_into_the_next():
    """Also when the number of drafts changes from one proposal to the next (the buffer is used in part)."""
    level = LookupLevel(10, "cpu", rows=2)
    propose(level, [[1, 2, 3, 1]], 3)
    for rows, k in [([[4, 5, 6, 4]], 3), ([[7, 8, 7], [1, 9, 1]], 2), ([[4, 5, 6, 4]], 3), ([[2, 2]], 1)]:
        _, tokens, q = propose(level, rows, k)
        assert torch.equal(q, torch.nn.functional.one_hot(tokens, 10).float())


def test_rejected_drafts_are_rolled_back():
    """The verifier kept one draft of [2, 3, 1] and put 9 after it: the next proposal is a fresh level's."""
    level = LookupLevel(10, "cpu")
    propose(level, [[1, 2, 3, 1]], 3)
    then = [1, 2, 3, 1, 2, 9]
    assert propose(level, [then], 3)[1].tolist() == propose(LookupLevel(10, "cpu"), [then], 3)[1].tolist()


def test_rows_that_sit_out_are_untouched_and_keep_moves_the_indexes():
    level = LookupLevel(10, "cpu", rows=2)
    seq, tokens, q = propose(level, [[1, 2, 1], [3, 4, 3]], 2, rows=[1])
    assert tokens.tolist() == [[4, 3]] and q.shape == (1, 2, 10)
    assert seq[0, 3:].tolist() == [0] * 29 and level.indexes[0].length == 0
    moved = level.indexes[1]
    level.keep([1])
    assert level.indexes == [moved]


def test_a_row_whose_last_tokens_occur_nowhere_earlier_drafts_nothing(tiny):
    """No earlier occurrence of the last token: the round takes one token from the full node's own
    distribution (plain decoding's), drafts and verifies nothing; with a match, it verifies GAMMA drafts."""
    model = tiny["gqa"].model
    prompt = list(range(3, 40)) + [250]  # every token once: nothing to look up after it
    cfg, capacity = model.config, len(prompt) + 2 * GAMMA + 4
    cache = FullCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, capacity, Rotary(cfg, capacity))
    full = Node("full", model, cache, GREEDY, capacity)
    lookup = LookupLevel(cfg.vocab_size, full.device)
    top = SpecLevel(lookup, full, GAMMA)
    seq = torch.zeros(1, capacity, dtype=torch.long)
    seq[0, :len(prompt)] = torch.tensor(prompt)
    assert lookup.draft_lengths(seq, [len(prompt)], GAMMA, [0]) == [0]
    [tokens], _ = top.round(seq, [len(prompt)], torch.Generator(), [0])
    assert tokens == ar(tiny["gqa"], prompt, 1) and top.stats.drafted[0] == 0 and top.stats.rounds[0] == 1
    seq[0, len(prompt)] = prompt[5]  # now the last token occurs earlier: a match, GAMMA drafts verified
    assert lookup.draft_lengths(seq, [len(prompt) + 1], GAMMA, [0]) == [GAMMA]
    top.round(seq, [len(prompt) + 1], torch.Generator(), [0])
    assert top.stats.drafted[0] == GAMMA


def drafts(level, tokens, k=GAMMA):
    """How many drafts the level makes after `tokens` (one row)."""
    seq = torch.zeros(1, len(tokens) + k + 1, dtype=torch.long)
    seq[0, :len(tokens)] = torch.tensor(tokens)
    return level.draft_lengths(seq, [len(tokens)], k, [0])[0]


def matched(level, tokens, k=GAMMA):
    return drafts(level, tokens, k) > 0


def test_a_record_judges_each_proposal_by_the_tokens_that_came_in_a_row():
    """A proposal is judged as the row's tokens reach it, whether drafted or not, its tokens that came
    counted as they come; it is decided at its first wrong token or once all of it came, and until then a
    newer proposal does not replace it. A size's chance starts at PRIOR and each judgement outweighs the
    older ones."""
    record = Record(range(1, 4))
    assert record.chance(1) == PRIOR
    record.expect(3, 1, [7, 8, 9])
    record.judge(np.array([1, 2, 3]))  # nothing at position 3 yet (or a level above rolled back): dropped
    assert record.came[1] == record.missed[1] == 0 and record.waiting == {}
    record.expect(3, 1, [7, 8, 9])
    record.judge(np.array([1, 2, 3, 7]))  # one came, the rest not yet known: it waits
    record.expect(4, 1, [5])  # not recorded while one of its size waits
    record.expect(4, 2, [8, 5])  # another size's is
    assert record.waiting == {1: [3, [7, 8, 9], 1], 2: [4, [8, 5], 0]} and record.came[1] == 1  # counted as it comes
    record.judge(np.array([1, 2, 3, 7, 8, 5]))  # two came in a row, then a wrong one; all of size 2's came
    assert (record.came[1], record.missed[1]) == (2, 1) and record.chance(1) == 2.5 / 4
    assert (record.came[2], record.missed[2]) == (2, 0) and record.waiting == {}
    record.expect(6, 1, [4, 4])
    record.judge(np.array([1, 2, 3, 7, 8, 5, 4, 4, 1]))  # all of it came: no miss
    assert (record.came[1], record.missed[1]) == (2 * DECAY + 2, DECAY) and record.chance(3) == PRIOR


def test_a_record_drafts_the_positions_whose_chance_reaches_the_threshold():
    """chance 0.5: one draft has 0.5 to come, two 0.25, three 0.125; k caps it."""
    record = Record([1])
    assert [record.length(1, 6, t) for t in (1.0, 0.6, 0.5, 0.3, 0.2, 0.1, 1e-9)] == [0, 0, 1, 1, 2, 3, 6]
    assert record.length(1, 2, 0.1) == 2


def test_matches_that_mislead_stop_drafting_and_longer_matches_that_repeat_draft():
    """Prose-like: every token follows 1 once, so the 1-gram after a 1 always proposes the previous
    follower, which is wrong: after a few judgements a 1-gram match declines (threshold 0 would draft it).
    Then a passage repeats: its 3-gram matches have no record yet, draft, are right, and go on drafting."""
    level, always = LookupLevel(300, "cpu", threshold=0.3), LookupLevel(300, "cpu")
    assert drafts(level, [1, 2, 3, 1]) == 1  # no record yet: a chance of PRIOR, one position at 0.3
    tokens, said = [], []
    for t in range(10, 30):
        tokens += [1, t]
        said.append(matched(level, tokens[:-1]))
        assert matched(always, tokens[:-1]) == (t > 10)  # the first 1 has nothing before it
    assert said[1] and not any(said[-10:]), said  # drafts at first (PRIOR), declines once judged wrong
    passage = list(range(100, 140))
    tokens += passage + passage[:3]
    for t in passage[3:20]:
        assert matched(level, tokens) and level.indexes[0].match()[0] == 3
        tokens.append(t)
    assert level.records[0].chance(3) > 0.9 and drafts(level, tokens) == GAMMA


def test_threshold_one_never_drafts():
    level = LookupLevel(10, "cpu", threshold=1.0)
    assert not any(matched(level, [1, 2, 3, 1, 2, 3, 1, 2][:n]) for n in range(2, 9))
