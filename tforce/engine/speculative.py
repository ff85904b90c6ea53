"""Standard speculative sampling, vectorised over a proposal and over rows, with one host sync per
verification (transfer.host: the numbers accepted and the next tokens, fetched together).

Given drafted tokens x_1..x_k drawn from q_1..q_k, and the verifier's p_1..p_{k+1} at the same positions:
accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) in order; at the first rejection i draw the
replacement from normalise(max(0, p_i - q_i)); when all are accepted draw a bonus token from p_{k+1}.
The result is distributed exactly as sampling from p (Leviathan et al. 2023; Chen et al. 2023).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import residual as exact_residual
from .sampling import RowGenerators, sample
from ..transfer import host, to_device


@dataclass
class Proposal:
    tokens: torch.Tensor  # (k,) long
    probs: torch.Tensor  # (k, V): the distribution each token was drawn from


def verify(tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gen, residual=exact_residual,
           greedy: bool = False, lengths: list[int] | None = None) -> tuple[list[int], list[int]]:
    """B rows at once (one prompt: B = 1), each row deciding its own acceptance: tokens (B, k) drafted from
    q (B, k, V); p (B, k + 1, V) the verifier's distributions at the k drafted positions and the one after.
    Returns (accepted count per row, next token per row: the residual sample at the row's first rejection,
    or its bonus token), fetched in one host sync. gen: a torch.Generator, or sampling.RowGenerators (one per
    row: each row draws as alone). lengths: row b verifies only its first lengths[b] drafts (None: all k), as
    if it had drafted only those: the rest are not read, and where all of its own are accepted its next token
    is the bonus from p[b, lengths[b]]; with RowGenerators row b draws lengths[b] uniforms, as alone.

    `residual` is a parameter only so that a test can show a wrong one is caught. greedy: p and q are
    one-hot (sampling.sample) and each drafted token is its q's argmax, so the rule above decides without
    drawing: a draft stays while it is p's argmax (p(x) is 1, else 0), and the next token is p's argmax where
    the row stops (the residual of a one-hot p at a rejected token is p itself); no pass over q.
    """
    B, k = tokens.shape
    rows = torch.arange(B, device=p.device)
    cols = torch.arange(k, device=p.device).expand(B, k)
    limit = None if lengths is None else to_device(torch.tensor(lengths), p.device)  # (B,), without a sync
    if greedy:
        target = p.argmax(-1)  # (B, k + 1)
        n = torch.where(tokens == target[:, :k], k, cols).min(1).values if k else target.new_zeros(B)
        n = n if limit is None else torch.minimum(n, limit)
        n_acc, token = host(torch.stack([n, target[rows, n]]))
        return n_acc, token
    if isinstance(gen, RowGenerators):
        u = gen.rand(k, p.device, lengths)
    else:
        u = torch.rand(B, k, generator=gen, device=p.device)
    x = tokens[..., None]
    accepted = u * q.gather(2, x)[..., 0] < p[:, :k].gather(2, x)[..., 0]  # (B, k): u < p/q without dividing
    # First rejection, or k when every token is accepted.
    n = torch.where(accepted, k, cols).min(1).values if k else torch.zeros(B, dtype=torch.long, device=p.device)
    candidates = torch.cat([residual(p[:, :k], q), p[:, k:k + 1]], dim=1)  # (B, k + 1, V)
    n = n if limit is None else torch.minimum(n, limit)
    at = candidates[rows, n]  # indexing by tensors, not ints: no host sync
    if limit is not None:  # a row that accepted all of its own drafts: the bonus after them
        at = torch.where((n < limit)[:, None], at, p[rows, n])
    nxt = sample(at, gen, greedy)  # (B,)
    n_acc, token = host(torch.stack([n, nxt]))
    return n_acc, token
