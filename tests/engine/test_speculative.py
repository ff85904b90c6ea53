"""The verification rule on its own: fixed p and q over a small vocabulary, many seeded draws."""
import functools

import numpy as np
import pytest
import torch

from tforce.engine.sampling import RowGenerators, residual, sample, to_probs
from tforce.config import Sampling
from tforce.engine.speculative import verify

from stats_util import chi2_pvalue

V = 6


def verify_one(x, q, p, gen, **kw):
    """verify on one row: (accepted count, next token)."""
    [n], [token] = verify(x[None], q[None], p[None], gen, **kw)
    return n, token


def first_token_counts(p, q, n=6000, seed=0, **kw):
    """Draft k=2 tokens from q, verify against p; the first emitted token must be distributed as p[0]."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(V)
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=gen)[:, 0]  # (2,) one draw per position
        n_accepted, next_token = verify_one(x, q, p, gen, **kw)
        first = int(x[0]) if n_accepted > 0 else next_token
        counts[first] += 1
    return counts


def dists(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, V, generator=g).softmax(-1) ** 2


def normalised(x):
    return x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("case", ["generic", "all_accepted", "none_accepted"])
def test_first_token_is_exact(case):
    p = normalised(dists(1))
    if case == "generic":
        q = normalised(dists(2))[:2]
    elif case == "all_accepted":  # p == q: every draft accepted
        q = p[:2].clone()
    else:  # disjoint supports: every draft rejected, output comes from the residual (= p)
        p = p.clone()
        p[:, :3] = 0
        p = normalised(p)
        q = torch.zeros(2, V)
        q[:, :3] = 1 / 3
    counts = first_token_counts(p, q)
    assert chi2_pvalue(counts, p[0].numpy()) > 1e-3


def test_wrong_residual_is_caught():
    """Resampling a rejected token from p instead of the residual (the public reference's bug) is biased."""
    p = normalised(dists(1))
    q = normalised(dists(2))[:2]
    wrong = functools.partial(verify_one, residual=lambda p, q: p)
    gen = torch.Generator().manual_seed(0)
    counts = np.zeros(V)
    for _ in range(6000):
        x = torch.multinomial(q, 1, generator=gen)[:, 0]
        n_accepted, next_token = wrong(x, q, p, gen)
        counts[int(x[0]) if n_accepted > 0 else next_token] += 1
    assert chi2_pvalue(counts, p[0].numpy()) < 1e-6


def test_acceptance_counts_and_bonus():
    p = torch.eye(V)[[1, 2, 3]]
    q = torch.eye(V)[[1, 2]]
    v = verify_one(torch.tensor([1, 2]), q, p, torch.Generator().manual_seed(0))
    assert v == (2, 3)  # all accepted, bonus from p[2]
    v = verify_one(torch.tensor([1, 4]), torch.eye(V)[[1, 4]], p, torch.Generator().manual_seed(0))
    assert v == (1, 2)  # second rejected, replaced by argmax of the residual
    v = verify_one(torch.tensor([5, 2]), torch.eye(V)[[5, 2]], p, torch.Generator().manual_seed(0))
    assert v == (0, 1)  # rejected at once; later drafts never count


def test_residual_rule():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    assert torch.allclose(residual(p, q), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.equal(residual(p, p), p)  # no positive mass: fall back to p


def test_to_probs_transforms():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    greedy = to_probs(logits, Sampling(temperature=0))
    assert torch.equal(greedy, torch.tensor([[1.0, 0, 0, 0]]))
    top_k = to_probs(logits, Sampling(temperature=1, top_p=1, top_k=2))
    assert (top_k[0, 2:] == 0).all() and torch.allclose(top_k.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    top_p = to_probs(logits, Sampling(temperature=1, top_p=float(full[0]) + 1e-3))
    assert (top_p[0] > 0).tolist() == [True, True, False, False]  # smallest prefix reaching top_p
    hot = to_probs(logits, Sampling(temperature=0.5, top_p=1))
    assert torch.allclose(hot, (logits / 0.5).softmax(-1))


def test_greedy_draws_are_the_one_hot_argmax_multinomial_draws():
    """sample(..., greedy=True) takes the argmax of temperature 0's one-hot distributions instead of
    drawing: the same token multinomial draws, for a batch of rows and a proposal's positions; and a greedy
    verification decides what the drawing one does."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 50, generator=g)
    probs = to_probs(logits.view(-1, 50), Sampling(temperature=0)).view(4, 3, 50)
    assert torch.equal(sample(probs, g, greedy=True), sample(probs, g))
    assert sample(probs, g, greedy=True).shape == (4, 3)
    q, p = probs[:, :2], to_probs(torch.randn(12, 50, generator=g), Sampling(temperature=0)).view(4, 3, 50)
    p[0, :2] = q[0]  # row 0 accepts both drafts: its bonus token; the other rows reject at their first mismatch
    drafts = q.argmax(-1)
    assert verify(drafts, q, p, torch.Generator().manual_seed(1), greedy=True) == \
        verify(drafts, q, p, torch.Generator().manual_seed(2))
    n, _ = verify(drafts, q, p, g, greedy=True)
    assert n[0] == 2 and min(n) < 2
    # greedy=True decides without drawing: the drawing rule's outcome on one-hot p and q, whatever the drafts
    # agree on (every first-mismatch position, all accepted, nothing drafted)
    for trial in range(300):
        k = trial % 5
        q = to_probs(torch.randn(6 * k, 7, generator=g), Sampling(temperature=0)).view(6, k, 7)
        p = to_probs(torch.randn(6 * (k + 1), 7, generator=g), Sampling(temperature=0)).view(6, k + 1, 7)
        agree = torch.rand(6, k, generator=g) < 0.7
        p[:, :k] = torch.where(agree[..., None], q, p[:, :k])
        drafts = q.argmax(-1) if k else torch.zeros(6, 0, dtype=torch.long)
        assert verify(drafts, q, p, torch.Generator().manual_seed(trial), greedy=True) == \
            verify(drafts, q, p, torch.Generator().manual_seed(trial))


def test_a_row_verifies_only_its_own_number_of_drafts():
    """lengths: row b as if it had drafted only its first lengths[b] tokens. One-hot p agreeing with every
    draft: the rows keep lengths[b] drafts and take p's token after them (the bonus), not what the later
    drafts say; greedy decides the same."""
    p = torch.eye(V)[torch.tensor([[1, 2, 3, 4]] * 3)]
    q, drafts = p[:, :3], torch.tensor([[1, 2, 3]] * 3)
    for greedy in (False, True):
        assert verify(drafts, q, p, torch.Generator().manual_seed(0), greedy=greedy, lengths=[0, 1, 3]) == \
            ([0, 1, 3], [1, 2, 4])


def test_with_its_own_number_of_drafts_a_row_emits_the_target_distribution():
    """Row 0 verifies 1 of 2 drafts: after an accepted first draft its next token is the bonus from p[1]
    (all verify's k = 2 would draw it from the residual of p[1] against q[1], which a chi-square rejects)."""
    p, q = normalised(dists(1)), normalised(dists(2))[:2]
    gen = torch.Generator().manual_seed(0)
    counts = {1: np.zeros(V), 2: np.zeros(V)}
    for _ in range(6000):
        x = torch.multinomial(q, 1, generator=gen)[:, 0]
        for m in counts:
            [n], [token] = verify(x[None], q[None], p[None], gen, lengths=[1] if m == 1 else None)
            if n == 1:
                counts[m][token] += 1
    assert chi2_pvalue(counts[1], p[1].numpy()) > 1e-3
    assert chi2_pvalue(counts[2], p[1].numpy()) < 1e-6


def test_each_row_draws_what_it_draws_alone_with_its_number_of_drafts():
    """RowGenerators: a row verifying lengths[b] of k drafts in a batch decides and draws what it does alone
    with only those drafted, seed for seed (then its generator is where alone it would be)."""
    g = torch.Generator().manual_seed(5)
    lengths = [0, 2, 4]
    for trial in range(200):
        p = torch.rand(3, 5, V, generator=g).softmax(-1)
        q = torch.rand(3, 4, V, generator=g).softmax(-1)
        drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(3, 4)
        batch = RowGenerators([torch.Generator().manual_seed(trial * 3 + b) for b in range(3)])
        together = verify(drafts, q, p, batch, lengths=lengths)
        for b, m in enumerate(lengths):
            alone = RowGenerators([torch.Generator().manual_seed(trial * 3 + b)])
            [n], [token] = verify(drafts[b:b + 1, :m], q[b:b + 1, :m], p[b:b + 1, :m + 1], alone)
            assert (together[0][b], together[1][b]) == (n, token)
            assert torch.rand(1, generator=batch.gens[b]) == torch.rand(1, generator=alone.gens[0])
