"""One Session for one prompt and for a batch (session.py, decode.py): a one-prompt batch is generate, draw
for draw; what runs for one row only is refused for more in one line; finished rows are compacted away
while others go on, and the last row stays for a conversation's next question."""
import pytest
import torch

import tforce
from tforce.engine.batch import generate_batch
from tforce.config import Execution, RunConfig, Sampling, Speculation
from tforce.engine.decode import decode
from tforce.engine.session import Session

from model_helpers import prompts_of

SMALL = dict(budget=32, chunk_size=4, gamma1=2, gamma2=3, draft_budget=12, sinks=2, prefill_chunk=8,
             rebuild_every=10)
SAME = ("acceptance", "verifications", "tokens_per_verification", "rebuilds", "forwards")


@pytest.mark.parametrize("method", ["ar", "naive", "retrieval", "streaming", "triforce"])
def test_a_one_prompt_batch_is_generate_draw_for_draw(tiny, method):
    """Sampled with one seed, a batch of one prompt gives generate's tokens and counts: the same session
    with one row, the same draws from the generator."""
    [prompt] = prompts_of((45,), seed=5)
    kw = dict(draft=tiny["draft"], method=method, max_new_tokens=30, temperature=0.8, seed=3, ignore_eos=True,
              **SMALL)
    [row] = generate_batch(tiny["gqa"], [prompt], **kw)
    alone = tforce.generate(tiny["gqa"], prompt, **kw)
    assert row.tokens == alone.tokens and len(row.tokens) == 30
    for key in SAME:
        assert row.stats[key] == alone.stats[key], key


def test_rows_take_h2o_and_rowwise_verification(tiny):
    """Both once ran for one row only: h2o keeps each row's prompt scores (tests/engine/test_rows_retrieval.py), the
    row-wise verifier runs for any rows (tests/engine/test_rows_deterministic.py)."""
    model, draft = tiny["gqa"].model, tiny["draft"].model
    h2o = Speculation(method="triforce", policy="h2o", **{k: v for k, v in SMALL.items() if k != "prefill_chunk"})
    for rows in (1, 2):
        Session(model, draft, 20, 4, RunConfig(speculation=h2o, sampling=Sampling()), rows=rows)
        Session(model, None, 20, 4, RunConfig(speculation=Speculation(method="ar"), sampling=Sampling(), execution=Execution(deterministic=True)), rows=rows)


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_finished_rows_leave_and_the_last_stays(tiny, method):
    """Three rows with budgets 1, 28 and 6 (at most gamma2 + 1 = 4 tokens a round: they finish in that order,
    each in another round): after the first finishes the caches hold two rows, then one; the last row is not
    compacted away (a conversation's row answers the next question in place)."""
    spec = Speculation(method=method, **{k: v for k, v in SMALL.items() if k != "prefill_chunk"})
    prompts = prompts_of((7, 20, 12), seed=6)
    session = Session(tiny["gqa"].model, tiny["draft"].model, 20, 28, RunConfig(speculation=spec, sampling=Sampling(temperature=0)), rows=3)
    session.prefill(prompts)
    live = []
    real = session.round

    def round_(n, gen):
        live.append((list(session.ids), session.full.cache.rows))
        return real(n, gen)

    session.round = round_
    outs = decode(session, [len(p) for p in prompts], [1, 28, 6], torch.Generator().manual_seed(0), set())
    assert [len(o) for o in outs] == [1, 28, 6]
    assert live[0] == ([0, 1, 2], 3) and ([1, 2], 2) in live and live[-1] == ([1], 1)
    assert session.ids == [1] and session.full.cache.rows == 1
    for prompt, out, n in zip(prompts, outs, [1, 28, 6]):
        assert out == tforce.generate(tiny["gqa"], prompt, method="ar", max_new_tokens=n, temperature=0,
                                      ignore_eos=True).tokens
