"""The exact-distribution oracle of the sampling tests: a tiny-vocabulary (target, draft) pair, the target's
exact joint distribution of the next N_TOKENS tokens by enumeration, sampled sessions and batches, and their
chi-square p-values against it (tests/engine/test_exactness.py for one prompt, tests/engine/test_batch.py for batch rows).
The pair itself is conftest.py's small_vocab fixture."""
import itertools

import numpy as np
import torch

import tforce
from tforce.cache import FullCache
from tforce.config import Execution, RunConfig, Sampling, Speculation
from tforce.engine.batch import generate_batch
from tforce.engine.generate import Session
from tforce.cache.rope import Rotary
from tforce.engine.sampling import to_probs
from tforce.model.synthetic import make_checkpoint

from stats_util import chi2_pvalue

SMALL = dict(budget=16, chunk_size=4, draft_budget=12, sinks=2, gamma1=2, gamma2=4)

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


def draw(target, draft, prompt, method, n_samples, seed, policy="retrieval", deterministic=False, proposer="model"):
    """n_samples independent generations of N_TOKENS tokens, each from a fresh session; the acceptance of
    the top level's drafts."""
    spec = Speculation(method=method, policy=policy, proposer=proposer, **dict(SMALL, gamma2=3))
    gen = torch.Generator().manual_seed(seed)
    samples, drafted, accepted = [], 0, 0
    for _ in range(n_samples):
        run = RunConfig(speculation=spec, sampling=SAMPLING, execution=Execution(deterministic=deterministic))
        session = Session(target, draft, len(prompt), N_TOKENS + 8, run)
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


# ---- batches: each row's tokens follow its own exact distribution ---------------------------------

ROWS = [PROMPT, PROMPT[:9], PROMPT[:2]]
BUDGETS = [N_TOKENS, 1, N_TOKENS]  # the middle row leaves the batch after its first token


BATCH_SAMPLING = dict(temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, top_k=SAMPLING.top_k, draft_budget=16,
                      sinks=2, gamma2=3, budget=16, chunk_size=4, gamma1=2, ignore_eos=True)


def draw_rows(target, draft, method, seed, **extra):
    """SAMPLES batches (rows of BUDGETS tokens each) -> per row, the list of sampled tuples; extra: more
    generate_batch options."""
    kw = dict(BATCH_SAMPLING, max_new_tokens=BUDGETS, **extra)
    level = {"naive": "draft", "triforce": "retrieval"}.get(method)  # the acceptance of the full cache's drafts
    samples, drafted, accepted = [[] for _ in ROWS], 0, 0
    for i in range(SAMPLES):
        for r, res in enumerate(generate_batch(target, ROWS, draft=draft, method=method, seed=seed * SAMPLES + i,
                                               **kw)):
            samples[r].append(tuple(res.tokens))
            if level and res.stats["verifications"]:  # a one-token row has only the prefill's token
                drafted += res.stats["verifications"]
                accepted += res.stats["acceptance"][level] * res.stats["verifications"]
    return samples, (accepted / drafted if drafted else None)


def pvalues(target, samples) -> list[float]:
    """Per row: check()'s p-values, or for a one-token row that token's against its exact distribution."""
    out = []
    for prompt, got, n in zip(ROWS, samples, BUDGETS):
        assert {len(s) for s in got} == {n}
        joint = exact_joint(target, prompt, N_TOKENS)
        if n == N_TOKENS:
            out += check(got, joint)
        else:
            first = np.zeros(V)
            for seq, p in joint.items():
                first[seq[0]] += p
            out.append(chi2_pvalue(np.bincount([s[0] for s in got], minlength=V), first))
    return out
