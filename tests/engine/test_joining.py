"""Rows joining a running Session between rounds and leaving it (engine/joining.py, Session.admit: a server's
continuous batching). Every row is what its prompt gives alone: greedy, `ar`'s tokens for every method and
the lookup draft, with rows joining mid-run, one finishing at once and another joining in its freed row;
sampled, each row's tokens follow its own exact target distribution (chi-square, as test_batch.py)."""
import pytest
import torch

import tforce
from tforce.config import Execution, RunConfig, Sampling, Speculation
from tforce.engine.joining import Joining
from tforce.engine.session import Session
from tforce.errors import TforceError

from exactness_helpers import BUDGETS, N_TOKENS, PROMPT, ROWS, SAMPLES, SAMPLING, pvalues
from model_helpers import prompts_of

SMALL = dict(draft_budget=12, sinks=2, gamma2=4, budget=16, chunk_size=4, gamma1=2)
CHUNK = 8  # several prefill chunks for the longer prompts, the last one partial
LENGTHS = (37, 13, 30, 21)  # the third moves to row 0 when the first finishes, its compacted draft window left in row 1
# Two rows: the second prompt finishes at its first token, the third joins in its freed row, the fourth
# in the first's once it finishes (a row that held 61 tokens, its draft window compacted)
BUDGET = (24, 1, 30, 18)


def session(target, draft, method, sampling, rows=3, proposer="model", longest=60, **extra):
    spec = Speculation(method=method, proposer=proposer, **SMALL, **extra)
    run = RunConfig(speculation=spec, sampling=sampling, execution=Execution(prefill_chunk=CHUNK))
    s = Session(target, None if proposer == "lookup" or method in ("ar", "retrieval") else draft, longest, 30,
                run, rows=rows)
    s.keep([])  # every row free
    return s


def run(s, gen, prompts, budgets, eos=frozenset(), seeds=None):
    """Prompt 0 joins first, prompt 1 after two rounds, prompt 2 after one more, prompt 3 once a row is
    free; every row to its end (seeds: each prompt's own generator's, else they share gen). Returns each
    prompt's tokens and its Row's stats."""
    j = Joining(s, gen, set(eos))
    out, index, stats = {}, {}, {}

    def join(i):
        own = None if seeds is None else torch.Generator().manual_seed(seeds[i])
        r, first, done = j.join(prompts[i], budgets[i], gen=own)
        index[r], out[i] = i, list(first)
        if done:
            stats[i] = j.done.pop(r).stats
            index.pop(r)

    join(0)
    for rounds in range(1000):
        if rounds in (2, 3):
            join(rounds - 1)
        if rounds > 3 and 3 not in out and j.free:
            join(3)
        if not j.rows and 3 in out:
            break
        for r, (tokens, done) in j.step().items():
            out[index[r]] += tokens
            if done:
                stats[index.pop(r)] = j.done.pop(r).stats
    return [out[i] for i in range(len(prompts))], [stats[i] for i in range(len(prompts))]


@pytest.mark.parametrize("method, proposer", [("ar", "model"), ("naive", "model"), ("retrieval", "model"),
                                              ("streaming", "model"), ("triforce", "model"), ("naive", "lookup"),
                                              ("triforce", "lookup")])
def test_greedy_rows_that_join_and_leave_equal_their_prompts_alone(tiny, method, proposer):
    prompts = prompts_of(LENGTHS, seed=3)
    s = session(tiny["gqa"].model, tiny["draft"].model, method, Sampling(temperature=0), rows=2, proposer=proposer)
    got, stats = run(s, torch.Generator().manual_seed(0), prompts, BUDGET)
    kw = dict(max_new_tokens=None, temperature=0, ignore_eos=True, prefill_chunk=CHUNK)
    for prompt, n, tokens, row in zip(prompts, BUDGET, got, stats):
        assert tokens == tforce.generate(tiny["gqa"], prompt, method="ar", **dict(kw, max_new_tokens=n)).tokens
        if proposer == "lookup":  # a batch's rows verify the drafts of rows without a match too (levels.py),
            continue  # which moves the middle level's cache: tokens alone's, acceptance not (as generate_batch)
        # greedy drafts are fixed: each level's acceptance and the verifications are exactly the prompt's alone
        # (the draft's window and the retrieval cache of a row in a finished prompt's place start afresh)
        draft = None if method in ("ar", "retrieval") else tiny["draft"]
        alone = tforce.generate(tiny["gqa"], prompt, draft=draft, method=method, proposer=proposer, **SMALL,
                                **dict(kw, max_new_tokens=n))
        assert row["acceptance"] == alone.stats["acceptance"]
        assert row["verifications"] == alone.stats["verifications"]
    assert s.ids == [] and len(s.verified) == 2  # each later prompt took a finished one's place


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_a_prefix_a_live_row_holds_is_copied_and_the_answers_stay_alone(tiny, method):
    """Three questions about one 40-token document: the second and third join while the first runs, copy
    the document's K/V from it (not prefilled again) and still answer as alone."""
    doc = prompts_of((40,), seed=5)[0]
    prompts = [doc + q for q in prompts_of((3, 6, 1), seed=6)]
    s = session(tiny["gqa"].model, tiny["draft"].model, method, Sampling(temperature=0))
    j = Joining(s, torch.Generator(), set())
    out, reused, index = {}, {}, {}
    for i, p in enumerate(prompts):
        rows = s.full.row_forwards
        r, first, _ = j.join(p, 12)
        out[i], index[r], reused[i] = list(first), i, j.rows[r].reused
        assert s.full.row_forwards - rows == (1 if i else 6)  # what is left after the copied document: one chunk
        for r2, (tokens, _) in j.step().items():  # a round of every live row before the next joins
            out[index[r2]] += tokens
    while j.rows:
        for r2, (tokens, _) in j.step().items():
            out[index[r2]] += tokens
    assert reused == {0: 0, 1: 40, 2: 40}
    for i, p in enumerate(prompts):
        alone = tforce.generate(tiny["gqa"], p, method="ar", max_new_tokens=12, temperature=0, ignore_eos=True,
                                prefill_chunk=CHUNK)
        assert out[i] == alone.tokens


@pytest.mark.parametrize("method, proposer", [("ar", "model"), ("naive", "model"), ("triforce", "model"),
                                              ("retrieval", "model"), ("naive", "lookup")])
def test_seeded_rows_that_join_draw_what_their_prompts_draw_alone(tiny, method, proposer):
    """Each row with a generator of its own (a request's seed) samples exactly the tokens the prompt gives
    alone with that seed, whatever the other rows draw and whenever it joins."""
    _seeded_rows_equal_alone(tiny, method, proposer)


def test_seeded_rows_with_a_lookup_record_draw_what_they_draw_alone(tiny):
    """--lookup-threshold: whether a row drafts depends on its own record only (a joining row's starts
    empty), so alone and joined it declines the same matches and draws the same tokens."""
    _seeded_rows_equal_alone(tiny, "triforce", "lookup", lookup_threshold=0.5)


def _seeded_rows_equal_alone(tiny, method, proposer, **extra):
    prompts, seeds = prompts_of(LENGTHS, seed=7), [11, 12, 13, 14]
    s = session(tiny["gqa"].model, tiny["draft"].model, method, Sampling(temperature=0.9, top_p=0.95), rows=2,
                proposer=proposer, **extra)
    out, _ = run(s, torch.Generator().manual_seed(123), prompts, BUDGET, seeds=seeds)
    draft = None if proposer == "lookup" or method in ("ar", "retrieval") else tiny["draft"]
    for i, prompt in enumerate(prompts):
        alone = tforce.generate(tiny["gqa"], prompt, draft=draft, method=method, proposer=proposer, **SMALL,
                                max_new_tokens=BUDGET[i], temperature=0.9, top_p=0.95, seed=seeds[i],
                                ignore_eos=True, prefill_chunk=CHUNK, **extra)
        assert out[i] == alone.tokens, i


def test_a_row_joining_is_prefilled_alone(tiny):
    """The joining row's prefill forwards feed it alone: the live rows sit them out (their caches untouched)."""
    s = session(tiny["gqa"].model, tiny["draft"].model, "ar", Sampling(temperature=0))
    j = Joining(s, torch.Generator(), set())
    prompts = prompts_of((9, 37), seed=4)
    j.join(prompts[0], 10)
    j.step()
    held, rows = s.full.held(0), s.full.row_forwards
    j.join(prompts[1], 10)
    assert s.full.held(0) == held
    assert s.full.row_forwards - rows == 5  # 37 tokens in chunks of 8, one row each


def test_a_full_session_refuses_one_more_row(tiny):
    s = session(tiny["gqa"].model, None, "ar", Sampling(temperature=0), rows=1)
    j = Joining(s, torch.Generator(), set())
    j.join([5, 6, 7], 4)
    assert j.free == 0
    with pytest.raises(TforceError, match="no free row"):
        j.join([5, 6], 4)


@pytest.mark.parametrize("method", ["naive", "triforce"])
def test_sampled_rows_that_join_follow_their_target_distributions(small_vocab, method):
    """exactness_helpers' rows (23, 9 and 2 tokens; budgets 3, 1, 3): the first joins alone, the second after
    one round (it finishes at its first token and leaves), the third after two, in the freed row."""
    target, draft = small_vocab
    gen = torch.Generator().manual_seed(7)
    samples = [[] for _ in ROWS]
    for _ in range(SAMPLES):
        s = session(target, draft, method, SAMPLING, longest=len(PROMPT))
        j = Joining(s, gen, set())
        out, index = {}, {}
        for step in range(100):
            if step < len(ROWS):
                r, first, done = j.join(ROWS[step], BUDGETS[step])
                out[step] = list(first)
                j.done.clear()
                if not done:
                    index[r] = step
            if not j.rows and len(out) == len(ROWS):
                break
            for r, (tokens, done) in j.step().items():
                out[index[r]] += tokens
        for i in range(len(ROWS)):
            samples[i].append(tuple(out[i]))
    assert {len(x) for x in samples[0]} == {N_TOKENS}
    assert min(pvalues(target, samples)) > 1e-3
