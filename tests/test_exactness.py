"""Every speculative method against plain decoding: greedy token for token, and sampling by chi-square
against the exact target distribution (computed by enumeration on a tiny vocabulary)."""
import functools
import itertools

import numpy as np
import pytest
import torch

import tforce
import tforce.engine.levels
from tforce.cache import FullCache
from tforce.config import Sampling, Speculation
from tforce.engine.generate import Session
from tforce.cache.rope import Rotary
from tforce.engine.sampling import to_probs
from tforce.engine.speculative import verify
from tforce.model.synthetic import make_checkpoint

from model_helpers import eos_token
from stats_util import chi2_pvalue

SPECULATIVE = ["triforce", "retrieval", "streaming", "naive"]
SMALL = dict(budget=16, chunk_size=4, draft_budget=12, sinks=2, gamma1=2, gamma2=4)


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

V = 6
N_TOKENS = 3  # tokens per sample: positions 1..3, each verified at a different offset in a round
SAMPLES = 1000
SAMPLING = Sampling(temperature=0.9, top_p=0.95, top_k=5)


def vocab_pair(root, draft_vocab: int = V, weights=None, **target):
    """(target, draft) networks over V ids; the draft's table holds the first draft_vocab of them; weights:
    the target's projections quantized (quant.py), target: its config overrides."""
    make_checkpoint(root / "t", seed=11, vocab_size=V, tokenizer=False, num_key_value_heads=2, **target)
    make_checkpoint(root / "d", seed=12, vocab_size=draft_vocab, tokenizer=False, hidden_size=32,
                    intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    return tforce.load_model(str(root / "t"), weights=weights).model, tforce.load_model(str(root / "d")).model


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return vocab_pair(tmp_path_factory.mktemp("v6"))


def exact_joint(model, prompt, n):
    """P(x_1..x_n | prompt) for every sequence, by enumeration: dict tuple -> prob."""
    out = {}
    for seq in itertools.product(range(V), repeat=n - 1):
        ids = torch.tensor([prompt + list(seq)])
        cache = FullCache(model.config.num_hidden_layers, model.n_kv_heads, model.head_dim, ids.shape[1],
                          Rotary(model.config, 64))
        cache.begin(ids.shape[1])
        probs = to_probs(model(ids, cache)[0, len(prompt) - 1:], SAMPLING)  # (n, V)
        pre = 1.0
        for i, x in enumerate(seq):
            pre *= float(probs[i, x])
        for x in range(V):
            out[seq + (x,)] = pre * float(probs[-1, x])
    return out


def draw(target, draft, prompt, method, n_samples, seed, policy="retrieval", deterministic=False):
    """n_samples independent generations of N_TOKENS tokens, each from a fresh session."""
    spec = Speculation(method=method, policy=policy, **dict(SMALL, gamma2=3))
    gen = torch.Generator().manual_seed(seed)
    samples, drafted, accepted = [], 0, 0
    for _ in range(n_samples):
        session = Session(target, draft, len(prompt), N_TOKENS + 8, spec, SAMPLING, deterministic=deterministic)
        session.prefill([prompt])
        n, got = len(prompt), []
        while len(got) < N_TOKENS:
            got += session.round([n + len(got)], gen)[0]
        samples.append(tuple(got[:N_TOKENS]))
        if method != "ar":
            drafted += session.top.stats.drafted[0]
            accepted += session.top.stats.accepted[0]
    return samples, (accepted / drafted if drafted else None)


def check(samples, joint):
    """p-values: the marginal of each position, and the joint of the first two."""
    pvals = []
    for i in range(N_TOKENS):
        marg = np.zeros(V)
        for seq, p in joint.items():
            marg[seq[i]] += p
        pvals.append(chi2_pvalue(np.bincount([s[i] for s in samples], minlength=V), marg))
    pair = np.zeros(V * V)
    for seq, p in joint.items():
        pair[seq[0] * V + seq[1]] += p
    pvals.append(chi2_pvalue(np.bincount([s[0] * V + s[1] for s in samples], minlength=V * V), pair))
    return pvals


PROMPT = [1, 4, 2, 0, 5, 3, 3, 1, 0, 2, 4, 4, 5, 1, 2, 0, 3, 5, 2, 1, 0, 4, 3]  # 23 tokens > budget 16


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
