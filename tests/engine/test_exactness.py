"""Every speculative method against plain decoding: greedy token for token, and sampling by chi-square
against the exact target distribution (computed by enumeration on a tiny vocabulary)."""
import functools

import pytest
import torch

import tforce
import tforce.engine.levels
from tforce.engine.speculative import verify

from exactness_helpers import N_TOKENS, PROMPT, SAMPLES, SMALL, check, draw, exact_joint, vocab_pair
from model_helpers import eos_token

SPECULATIVE = ["triforce", "retrieval", "streaming", "naive"]


def prompt_of(n, seed=0):
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("target", ["mha", "gqa", "yarn", "llama3"])
@pytest.mark.parametrize("prompt_len", [1, 13, 37])
def test_greedy_equals_plain_decoding(tiny, target, prompt_len):
    """Budgets smaller than the context so the retrieval and streaming caches really drop tokens;
    prompt lengths not a multiple of the chunk size; 48 tokens so the retrieval cache is rebuilt."""
    prompt = prompt_of(prompt_len, seed=prompt_len)
    kw = dict(max_new_tokens=48, temperature=0, ignore_eos=True)
    ar = tforce.generate(tiny[target], prompt, method="ar", **kw).tokens
    assert len(ar) == 48
    for method in SPECULATIVE:
        out = tforce.generate(tiny[target], prompt, draft=tiny["draft"], method=method, rebuild_every=8,
                              **SMALL, **kw)
        assert out.tokens == ar, method


@pytest.mark.parametrize("method", SPECULATIVE)
def test_greedy_with_default_budgets_and_gammas(tiny, method):
    """Defaults (budget 4096 > context: the retrieval cache holds everything, so it always agrees)."""
    prompt = prompt_of(29, seed=5)
    ar = tforce.generate(tiny["gqa"], prompt, method="ar", max_new_tokens=32, temperature=0, ignore_eos=True)
    out = tforce.generate(tiny["gqa"], prompt, draft=tiny["gqa"], method=method, max_new_tokens=32,
                          temperature=0, ignore_eos=True)
    assert out.tokens == ar.tokens
    if method in ("triforce", "retrieval"):
        assert out.stats["acceptance"]["retrieval"] == 1.0  # full-budget retrieval is the full cache


def test_seeded_runs_are_reproducible(tiny):
    kw = dict(draft=tiny["draft"], max_new_tokens=24, temperature=0.8, seed=7, ignore_eos=True, **SMALL)
    a = tforce.generate(tiny["gqa"], prompt_of(20), **kw).tokens
    b = tforce.generate(tiny["gqa"], prompt_of(20), **kw).tokens
    assert a == b


def test_eos_stops_generation(tiny):
    prompt = prompt_of(10)
    ar = tforce.generate(tiny["gqa"], prompt, method="ar", max_new_tokens=8, temperature=0, ignore_eos=True)
    eos = ar.tokens[3]
    with eos_token(tiny["gqa"].model, eos):
        for method in ["ar"] + SPECULATIVE:
            out = tforce.generate(tiny["gqa"], prompt, draft=tiny["draft"], method=method, max_new_tokens=8,
                                  temperature=0, **SMALL)
            assert out.tokens == ar.tokens[: ar.tokens.index(eos) + 1], method


# ---- sampling: exact distribution on a tiny vocabulary -------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_int4(tmp_path_factory):
    """The same kind of pair, the target's projections int4 (tforce/model/quant.py; shapes it takes)."""
    return vocab_pair(tmp_path_factory.mktemp("v6q"), weights="int4", intermediate_size=128)


def assert_samples_follow(target, draft, method, seed):
    """Samples of `method` against the target's exact joint distribution; and, for a speculative method,
    drafts both accepted and rejected (else the test would mean nothing)."""
    joint = exact_joint(target, PROMPT, N_TOKENS)
    samples, acc = draw(target, draft, PROMPT, method, SAMPLES, seed=seed)
    pvals = check(samples, joint)
    assert min(pvals) > 1e-3, pvals
    if method != "ar":
        assert 0.1 < acc < 0.95, acc


@pytest.mark.parametrize("method", ["triforce", "naive"])
def test_sampling_on_int4_weights_matches_the_quantized_target(small_vocab_int4, method):
    """Exactness relative to the model as loaded: the distribution is the int4 target's own."""
    assert_samples_follow(*small_vocab_int4, method, seed=3)


@pytest.mark.parametrize("method", ["ar"] + SPECULATIVE)
def test_sampling_matches_target_distribution(small_vocab, method):
    assert_samples_follow(*small_vocab, method, seed=1)


@pytest.mark.parametrize("policy", ["shared", "topk"])
def test_sampling_with_other_middle_policies_matches_target_distribution(small_vocab, policy):
    target, draft = small_vocab
    joint = exact_joint(target, PROMPT, N_TOKENS)
    samples, acc = draw(target, draft, PROMPT, "triforce", SAMPLES, seed=2, policy=policy)
    assert min(check(samples, joint)) > 1e-3
    assert 0.1 < acc < 0.95, acc


@pytest.mark.parametrize("method", ["triforce", "retrieval"])
def test_sampling_with_rowwise_verification_matches_target_distribution(small_vocab, method):
    """deterministic=True changes how the verifier computes its logits (row by row), not the rule."""
    target, draft = small_vocab
    joint = exact_joint(target, PROMPT, N_TOKENS)
    samples, acc = draw(target, draft, PROMPT, method, SAMPLES, seed=3, deterministic=True)
    assert min(check(samples, joint)) > 1e-3
    assert 0.1 < acc < 0.95, acc


@pytest.mark.parametrize("method", ["triforce", "naive"])
def test_wrong_residual_fails_the_same_test(small_vocab, method, monkeypatch):
    """The public reference resamples rejected tokens from the verifier's distribution instead of the
    residual; with that rule the same check must fail."""
    monkeypatch.setattr(tforce.engine.levels, "verify", functools.partial(verify, residual=lambda p, q: p))
    target, draft = small_vocab
    joint = exact_joint(target, PROMPT, N_TOKENS)
    samples, _ = draw(target, draft, PROMPT, method, SAMPLES, seed=1)
    assert min(check(samples, joint)) < 1e-6
