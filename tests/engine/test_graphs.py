"""CUDA graph replay against eager execution (CUDA only)."""
import pytest
import torch

import tforce
from tforce.config import RunConfig, Sampling, Speculation
from tforce.engine.generate import Session


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["triforce", "retrieval", "streaming", "naive"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_replay_equals_eager(tiny_dir, method, temperature):
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32)
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32)
    prompt = list(range(3, 120))
    kw = dict(draft=draft, method=method, max_new_tokens=40, temperature=temperature, seed=1, ignore_eos=True,
              budget=32, chunk_size=4, draft_budget=24, sinks=4)
    eager = tforce.generate(target, prompt, cuda_graphs=False, **kw).tokens
    graphed = tforce.generate(target, prompt, cuda_graphs=True, **kw).tokens
    assert graphed == eager


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["triforce", "retrieval", "streaming"])
def test_batch_graph_replay_equals_eager(tiny_dir, method):
    """A batch replays graphs captured per live row count while its rows share one view (two rows are one
    prompt, so they stay in step); its rows equal the eager batch's (test_gpu_semantics.py: the same on the
    CPU through a stand-in for the graph API)."""
    from tforce.engine.batch import generate_batch

    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32).model
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32).model
    same = list(range(3, 120))
    prompts = [same, list(range(130, 247)), same, list(range(40, 157))]
    kw = dict(draft=draft, method=method, max_new_tokens=[40, 20, 40, 25], temperature=0, ignore_eos=True, budget=32,
              chunk_size=4, draft_budget=24, sinks=4)
    eager = [_row(r) for r in generate_batch(target, prompts, cuda_graphs=False, **kw)]
    assert [_row(r) for r in generate_batch(target, prompts, cuda_graphs=True, **kw)] == eager


def _row(result):
    """A greedy row's tokens and what its drafts did: the full cache fixes the tokens whatever the drafts
    were, so a graph replaying stale inputs at a draft or middle level shows in the acceptance only."""
    return result.tokens, result.stats["acceptance"], result.stats["verifications"]


@pytest.mark.cuda
def test_draft_and_middle_steps_replay_graphs(tiny_dir):
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32).model
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32).model
    spec = Speculation(budget=32, chunk_size=4, draft_budget=24, sinks=4)
    session = Session(target, draft, 120, 40, RunConfig(speculation=spec, sampling=Sampling(temperature=0)))
    prompt = torch.arange(3, 123)
    session.prefill([prompt])
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = len(prompt)
    while n < len(prompt) + 40:
        n += len(session.round([n], gen)[0])
    assert session.small.runner.replays > 0 and session.middle.runner.replays > 0


@pytest.mark.cuda
def test_graphs_are_captured_after_prefill_in_one_pool(tiny_dir):
    """The draft's (1 and 2 tokens) and the middle level's (gamma1 + 1 tokens) graphs exist before the
    first round, and every runner allocates from the same pool."""
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32).model
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32).model
    spec = Speculation(gamma1=2, budget=32, chunk_size=4, draft_budget=24, sinks=4)
    session = Session(target, draft, 120, 40, RunConfig(speculation=spec, sampling=Sampling(temperature=0)))
    session.prefill([torch.arange(3, 123)])
    assert {key[:2] for key in session.small.runner.graphs} == {(1, 1), (2, 1)}
    assert {key[:2] for key in session.middle.runner.graphs} == {(3, 3)}
    assert session.small.runner.pool is not None and session.small.runner.pool == session.middle.runner.pool
