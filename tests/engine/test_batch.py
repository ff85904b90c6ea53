"""generate_batch: every row of a batch is what `generate` gives for that prompt alone (greedy token for
token, with rows of different lengths and rows that finish early), and sampled rows follow the exact
target distribution (chi-square, as tests/engine/test_exactness.py does for one prompt)."""
import functools

import pytest

import tforce
import tforce.engine.nodes
import tforce.engine.levels
from tforce.engine import placement
from tforce.config import Speculation
from tforce.engine.batch import generate_batch
import tforce.engine.session
from tforce.engine.session_plan import plan_session, model_shape
from tforce.engine.speculative import verify
from tforce.model.synthetic import make_checkpoint
from tforce.engine.events import Events

from exactness_helpers import draw_rows, pvalues
from model_helpers import eos_token, prompts_of, record_host

LENGTHS = (1, 13, 37, 5)  # a one-token prompt, lengths not a multiple of the prefill chunk
SMALL = dict(draft_budget=12, sinks=2, gamma2=4, prefill_chunk=8)  # the draft's window really drops tokens


@pytest.mark.parametrize("target", ["gqa", "llama3"])
@pytest.mark.parametrize("method", ["ar", "naive"])
@pytest.mark.parametrize("lengths", [LENGTHS, (9, 9, 9)])  # (9, 9, 9): ar's rows stay of one length
def test_greedy_rows_equal_single_prompts(tiny, target, method, lengths):
    prompts = prompts_of(lengths)
    kw = dict(max_new_tokens=30, temperature=0, ignore_eos=True)
    rows = generate_batch(tiny[target], prompts, draft=tiny["draft"], method=method, **SMALL, **kw)
    assert len(rows) == len(prompts)
    for prompt, row in zip(prompts, rows):
        alone = tforce.generate(tiny[target], prompt, method="ar", **kw)
        assert row.tokens == alone.tokens
        assert len(row.tokens) == 30


def test_naive_rows_accept_what_they_would_alone(tiny):
    """The draft is the target itself with a 12-token StreamingLLM window: greedy, each row's drafts are
    then fixed, so its acceptance and verification count must be exactly those of the prompt alone
    (the batched streaming cache's views and the per-row acceptance, checked together)."""
    prompts = prompts_of(LENGTHS, seed=1)
    kw = dict(draft=tiny["gqa"], method="naive", max_new_tokens=30, temperature=0, ignore_eos=True, **SMALL)
    rows = generate_batch(tiny["gqa"], prompts, **kw)
    accepted = []
    for prompt, row in zip(prompts, rows):
        alone = tforce.generate(tiny["gqa"], prompt, **kw)
        assert row.tokens == alone.tokens
        assert row.stats["acceptance"] == alone.stats["acceptance"]
        assert row.stats["verifications"] == alone.stats["verifications"]
        accepted.append(row.stats["acceptance"]["draft"])
    assert len(set(accepted)) > 1 and 0 < max(accepted) < 1  # rows really accept different counts


@pytest.mark.parametrize("method", ["ar", "naive"])
def test_a_row_that_stops_at_eos_leaves_the_others_unchanged(tiny, method):
    prompts = prompts_of(LENGTHS, seed=2)
    model = tiny["gqa"].model
    first = tforce.generate(model, prompts[1], method="ar", max_new_tokens=8, temperature=0, ignore_eos=True)
    with eos_token(model, first.tokens[3]):
        kw = dict(draft=tiny["draft"], method=method, max_new_tokens=20, temperature=0, **SMALL)
        rows = generate_batch(model, prompts, **kw)
        alone = [tforce.generate(model, p, **kw).tokens for p in prompts]
    assert [r.tokens for r in rows] == alone
    assert len(rows[1].tokens) <= 4 < 20 == max(len(t) for t in alone)  # one finished early, others went on


@pytest.mark.parametrize("method", ["ar", "naive"])
def test_offloaded_rows_equal_single_prompts(tiny, method):
    """Every layer of the batch's KV in host memory (cache/offload.py), streamed per step for all
    rows, one row leaving early at EOS (the host rows are compacted): every row is still its prompt
    alone, bit for bit on the CPU."""
    prompts = prompts_of(LENGTHS, seed=3)
    model = tiny["gqa"].model
    first = tforce.generate(model, prompts[0], method="ar", max_new_tokens=8, temperature=0, ignore_eos=True)
    with eos_token(model, first.tokens[2]):
        kw = dict(max_new_tokens=20, temperature=0)
        rows = generate_batch(model, prompts, draft=tiny["draft"], method=method, offload="on", **SMALL, **kw)
        alone = [tforce.generate(model, p, method="ar", **kw).tokens for p in prompts]
    assert [r.tokens for r in rows] == alone
    assert len(alone[0]) <= 3 < max(len(t) for t in alone)  # row 0 left first; the others went on


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_partly_offloaded_rows_equal_single_prompts(tiny, tmp_path, monkeypatch, method):
    """A 6-layer target with room on the 'device' (device_free) for 3 layers of the batch's KV: 3 resident,
    3 streamed (with 2 layers, offloading one never saves memory: the staging buffers hold two); the
    prefill is layer-major (prefill.py), the retrieval statistics taken during it."""
    make_checkpoint(tmp_path / "six", seed=5, num_hidden_layers=6)
    model = tforce.load_model(str(tmp_path / "six")).model
    draft = tiny["draft"].model if method == "triforce" else None
    prompts = prompts_of(LENGTHS, seed=4)
    kw = dict(max_new_tokens=20, temperature=0, ignore_eos=True)
    spec = Speculation(method=method, budget=16, chunk_size=4, gamma2=4, draft_budget=12, sinks=2)
    work = placement.Work(37 + 20 + spec.max_lookahead + 1, 36, spec, 8, False, "math", rows=4)
    shape, small = model_shape(model), (model_shape(draft) if draft is not None else None)
    room = placement.layout(shape, work, 3, small, 0).peak - shape.weights - (small.weights if small else 0)
    plans = []
    monkeypatch.setattr(tforce.engine.nodes, "plan_session", lambda *a: plans.append(plan_session(*a)) or plans[-1])
    opts = dict(budget=16, chunk_size=4, gamma2=4, draft_budget=12, sinks=2, prefill_chunk=8)
    rows = generate_batch(model, prompts, draft=draft, method=method, device_free=room, **opts, **kw)
    assert (plans[0].resident, plans[0].offloaded) == (3, 3)
    for prompt, row in zip(prompts, rows):
        assert row.tokens == tforce.generate(model, prompt, method="ar", **kw).tokens


def test_rows_with_different_budgets_finish_at_their_own(tiny):
    """A row whose prompt nearly fills the context gets fewer new tokens (as alone), then leaves."""
    context = tiny["gqa"].model.config.max_position_embeddings
    prompts = prompts_of((context - 3, 7))
    rows = generate_batch(tiny["gqa"], prompts, method="ar", max_new_tokens=10, temperature=0, ignore_eos=True)
    assert [len(r.tokens) for r in rows] == [3, 10]
    alone = tforce.generate(tiny["gqa"], prompts[1], method="ar", max_new_tokens=10, temperature=0, ignore_eos=True)
    assert rows[1].tokens == alone.tokens


def test_on_row_hears_each_row_once_when_it_finishes(tiny):
    """In the order the rows finish (a row without budget at once), each with its final tokens."""
    heard = []
    rows = generate_batch(tiny["gqa"], prompts_of((5, 9, 3)), method="ar", max_new_tokens=[6, 2, 0], temperature=0,
                          ignore_eos=True, events=Events(on_row=lambda r, tokens: heard.append((r, tokens))))
    assert heard == [(2, []), (1, rows[1].tokens), (0, rows[0].tokens)] and len(rows[0].tokens) == 6


def test_refusals(tiny):
    with pytest.raises(tforce.UsageError, match="prompt 2 of the batch is empty"):
        generate_batch(tiny["gqa"], [[5, 6], []])
    with pytest.raises(tforce.UsageError, match="needs a draft"):
        generate_batch(tiny["gqa"], [[5, 6]], method="naive")
    with pytest.raises(tforce.UsageError, match="2 budgets for 1 prompts"):
        generate_batch(tiny["gqa"], [[5, 6]], max_new_tokens=[3, 4])
    with pytest.raises(tforce.UsageError, match=r"runs --method ar\|triforce\|naive\|retrieval\|streaming, not 'auto'"):
        generate_batch(tiny["gqa"], [[5, 6]], method="auto")  # the command line chooses one before a batch


def test_a_batch_that_does_not_fit_is_refused_before_allocating(tiny):
    """Planned with B rows: room for one row's KV cache is not room for eight (errors.DoesNotFit)."""
    prompts = prompts_of((300,) * 8)
    model = tiny["gqa"].model
    one = placement.Work(capacity=300 + 40 + 1, prompt=300, attention="math", spec=Speculation(method="ar"))
    room = plan_session(model, None, one, "off", None, 2**40).peak - model_shape(model).weights
    tforce.generate_batch(model, prompts[:1], method="ar", max_new_tokens=30, device_free=room)
    with pytest.raises(tforce.DoesNotFit, match="not enough GPU memory"):  # `run --batch` splits on this type
        tforce.generate_batch(model, prompts, method="ar", max_new_tokens=30, device_free=room)


# ---- sampling: each row's tokens follow its own exact distribution ---------------------------------


@pytest.mark.parametrize("method, policy", [("ar", "retrieval"), ("naive", "retrieval"), ("triforce", "retrieval"),
                                            ("triforce", "h2o")])
def test_sampled_rows_match_their_target_distributions(small_vocab, method, policy):
    """triforce: the 23-token row's middle cache holds 16 of its tokens, rebuilt before every round (h2o: its
    own prompt's heavy hitters and its newest tokens; the middle row leaves first, so the last row moves)."""
    target, draft = small_vocab
    samples, acc = draw_rows(target, draft, method, seed=1, policy=policy)
    assert min(pvalues(target, samples)) > 1e-3
    if method != "ar":  # drafts both accepted and rejected, or the test means little
        assert 0.1 < acc < 0.95, acc


def test_wrong_residual_fails_the_same_test(small_vocab, monkeypatch):
    monkeypatch.setattr(tforce.engine.levels, "verify", functools.partial(verify, residual=lambda p, q: p))
    target, draft = small_vocab
    samples, _ = draw_rows(target, draft, "naive", seed=1)
    assert min(pvalues(target, samples)) < 1e-6


def test_one_host_transfer_per_step_for_all_rows(tiny, monkeypatch):
    """ar: one device -> host transfer per step carrying every live row's token, never one per row;
    naive: one per drafted token (all rows) and one per verification (all rows' counts and next tokens)."""
    calls = record_host(monkeypatch)
    prompts = prompts_of((5, 9, 3))
    generate_batch(tiny["gqa"], prompts, method="ar", max_new_tokens=[10, 10, 4], temperature=0, ignore_eos=True)
    assert calls == [3] * 4 + [2] * 6  # the first tokens (from the prefill), then rounds; the third row left
    calls.clear()
    rows = generate_batch(tiny["gqa"], prompts, draft=tiny["draft"], method="naive", max_new_tokens=10, temperature=0,
                          ignore_eos=True, **dict(SMALL, gamma2=3))
    rounds = max(r.stats["verifications"] for r in rows)
    # the first tokens from the prefill (one transfer), then per round 3 drafts and 1 verdict
    assert len(calls) == 1 + rounds * (3 + 1) and calls[0] == 3 and set(calls[1:5]) == {3, 6}


@pytest.mark.parametrize("offload", ["off", "on"])
def test_progress_callbacks_count_the_batch(tiny, offload):
    """on_prefill reaches its total (tokens, or token-layers layer-major); on_round hears every row's tokens
    of each round, as cut, and each level's (accepted, drafted) over the batch's rows: the rows' own figures."""
    prefill, tokens, counts = [], [[] for _ in range(3)], []

    def on_round(new, c):
        for r, t in new.items():
            tokens[r] += t
        counts.append(c)

    rows = generate_batch(tiny["gqa"], prompts_of((5, 19, 2)), draft=tiny["draft"], method="naive",
                          max_new_tokens=[6, 12, 3], temperature=0, ignore_eos=True, offload=offload,
                          events=Events(on_prefill=lambda d, t: prefill.append((d, t)), on_round=on_round), **SMALL)
    assert prefill and prefill[-1][0] == prefill[-1][1] > 0 and all(d <= t for d, t in prefill)
    assert tokens == [r.tokens for r in rows]
    verified = [r.stats["verifications"] for r in rows]
    accepted = sum(r.stats["acceptance"]["draft"] * v * SMALL["gamma2"] for r, v in zip(rows, verified))
    assert counts[-1]["retrieval"] is None and counts[-1]["draft"][1] == SMALL["gamma2"] * sum(verified)
    assert counts[-1]["draft"][0] == pytest.approx(accepted)


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_dynamic_ntk_rows_equal_plain_decoding(tmp_path, tiny, method):
    """Dynamic NTK RoPE fixes its frequencies per generation from the longest length it reaches, which never
    passes the model's context, where transformers keeps one set of frequencies: a batch's rows of
    different lengths and budgets are each the prompt alone (tests/model/test_model.py: against transformers)."""
    path = make_checkpoint(tmp_path / "dynamic", seed=7, num_key_value_heads=2, max_position_embeddings=96,
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model = tforce.load_model(str(path), tokenizer=False).model
    prompts = prompts_of((60, 9, 33), seed=2)
    budgets = [20, 40, 30]  # one row reaches 80 of 96 positions, another 49
    kw = dict(draft=tiny["draft"], method=method, temperature=0, ignore_eos=True, budget=32, chunk_size=4,
              draft_budget=16, sinks=2)
    rows = generate_batch(model, prompts, max_new_tokens=budgets, **kw)
    for p, n, row in zip(prompts, budgets, rows):
        assert row.tokens == tforce.generate(model, p, method="ar", temperature=0, ignore_eos=True,
                                             max_new_tokens=n).tokens
