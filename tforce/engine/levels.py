"""The speculation hierarchy as composition, over B rows (one prompt: B = 1), of Nodes (node.py: one
network with one cache and the record of what each row of it holds).

A Level produces tokens together with the distribution each was drawn from, per row:
- Drafter(node): autoregressive sampling from the node, one token per round.
- SpecLevel(proposer, node, gamma): the proposer drafts gamma tokens, the node verifies them with
  speculative sampling, and the round yields the accepted tokens plus the residual or bonus token,
  each labelled with the *node's* distribution at its position. The yielded sequence is an exact sample
  of the node's own distribution, so a SpecLevel is itself a proposer for the level above: that is
  the whole hierarchy (triforce = SpecLevel(SpecLevel(Drafter(draft), middle, g1), full, g2)).
Each row accepts its own number of drafted tokens. A level proposing k tokens repeats its rounds until
every row has k; a row that has them sits the later rounds out (a round is for the rows it lists), so
each row drafts and is fed exactly what its prompt alone would be, and a cache that runs forwards over
some of its rows (`cache.subsets`) runs them without it (docs/architecture.md, "Protocol").

Host and device: node.py.
"""
from __future__ import annotations

import torch

from .node import Node
from .sampling import pick, sample
from .speculative import verify
from ..transfer import host, to_device


REBUILD_WINDOW = 8  # rounds whose mean acceptance the low-acceptance rebuild rule reads (Session._maybe_rebuild)


class LevelStats:
    """Per prompt (the caller's index; live row i is prompt ids[i]): rounds, drafted, accepted, and the
    acceptance of recent rounds for rebuild decisions (REBUILD_WINDOW of them)."""

    def __init__(self, n: int = 1, window: int = REBUILD_WINDOW):
        self.rounds, self.drafted, self.accepted = [0] * n, [0] * n, [0] * n
        self.recent: list[list[float]] = [[] for _ in range(n)]
        self.window = window

    def count(self, r: int, gamma: int, n_accepted: int) -> None:
        self.rounds[r] += 1
        self.drafted[r] += gamma
        self.accepted[r] += n_accepted
        self.recent[r] = (self.recent[r] + [n_accepted / gamma])[-self.window:]

    def clear(self, r: int) -> None:
        """Prompt r counts from nothing (a new request in a reused place: Session.admit); r == len: one more."""
        if r == len(self.rounds):
            for counts in (self.rounds, self.drafted, self.accepted, self.recent):
                counts.append(None)
        self.rounds[r] = self.drafted[r] = self.accepted[r] = 0
        self.recent[r] = []

    def step(self, r: int) -> None:
        """A round that drafted nothing (SpecLevel._step): no acceptance to count."""
        self.rounds[r] += 1

    def acceptance(self, r: int = 0) -> float | None:
        return self.accepted[r] / self.drafted[r] if self.drafted[r] else None

    def low(self, r: int, below: float) -> bool:
        """Whether prompt r's mean acceptance over the last `window` rounds is under `below`."""
        recent = self.recent[r]
        return len(recent) == self.window and sum(recent) / len(recent) < below


class Level:
    """Produces tokens continuing each row's sequence seq[b, :n[b]], each with the distribution it was
    drawn from."""

    def round(self, seq: torch.Tensor, n: list[int], gen: torch.Generator, rows: list[int] | None = None
              ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """For each listed row (None: every row), in that order: new tokens (written into seq[b, n[b]:]) and
        their distributions (n_b, V). The other rows take no part: their caches and sequences are left as
        they are."""
        raise NotImplementedError

    def propose(self, seq: torch.Tensor, n: list[int], k: int, gen: torch.Generator, rows: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exactly k tokens for each listed row (written into seq[b, n[b]:n[b] + k]): (R, k) ids, (R, k, V)
        their distributions. Rounds repeat until every row has k; a row that has them sits the later rounds
        out, so it drafts exactly what it would alone."""
        have, probs = dict.fromkeys(rows, 0), {b: [] for b in rows}
        while more := [b for b in rows if have[b] < k]:
            t, p = self.round(seq, [nb + have.get(b, 0) for b, nb in enumerate(n)], gen, more)
            for b, tb, pb in zip(more, t, p):
                have[b] += len(tb)
                probs[b].append(pb)
        tokens = torch.stack([seq[b, n[b]:n[b] + k] for b in rows])
        return tokens, torch.stack([torch.cat(probs[b])[:k] for b in rows])


class Drafter(Level):
    def __init__(self, node: Node):
        self.node = node
        self.logprobs = None  # with node.raw: per listed row of the last round, its tokens' raw log-probs (1, V)

    def round(self, seq, n, gen, rows=None):
        rows = list(range(len(n))) if rows is None else rows
        p = self.node.probs(seq, n, rows=rows)[:, 0]  # (R, V)
        # A host sync per drafted token (all rows): the tokens join the host-side sequences that every
        # node's catch-up (Node.probs) compares against. The verification's sync comes on top (speculative.py).
        tokens = host(sample(p, pick(gen, rows), self.node.sampling.greedy))
        for b, t in zip(rows, tokens):
            seq[b, n[b]] = t
        self.logprobs = list(self.node.logprobs[:, :1]) if self.node.raw else None
        return [[t] for t in tokens], list(p[:, None])


class SpecLevel(Level):
    def __init__(self, proposer: Level, node: Node, gamma: int, ids: list[int] | None = None, n_prompts: int = 1,
                 window: int = REBUILD_WINDOW):
        self.proposer, self.node, self.gamma, self.window = proposer, node, gamma, window
        self.ids = [0] if ids is None else ids  # live row i is prompt ids[i] (the caller's list, updated in place)
        self.stats = LevelStats(n_prompts, window)
        self.logprobs = None  # with node.raw: per listed row of the last round, its tokens' raw log-probs (k, V)

    def round(self, seq, n, gen, rows=None):
        rows = list(range(len(n))) if rows is None else rows
        # A proposer that can tell (lookup.py) says how many drafts each row has worth verifying, at most
        # gamma (0: none); else every row verifies gamma. The round drafts the most any row has and each row
        # verifies its own (verify's lengths): a row with none takes its token from the node's distribution at
        # its first position, as a round that drafted nothing. The lengths depend on the tokens so far only,
        # so each row stays an exact sample of the node and draws from its generator what it would alone.
        lengths_of = getattr(self.proposer, "draft_lengths", None)
        lengths = lengths_of(seq, n, self.gamma, rows) if lengths_of else [self.gamma] * len(rows)
        k = max(lengths)
        if k == 0:
            return self._step(seq, n, gen, rows)
        drafts, q = self.proposer.propose(seq, n, k, gen, rows)  # writes seq[b, n:n + k]
        p = self.node.probs(seq, [nb + k for nb in n], last=k + 1, rows=rows)  # (R, k + 1, V)
        raw = self.node.logprobs if self.node.raw else None
        n_acc, nxt = verify(to_device(drafts, p.device), q.to(p.device), p, pick(gen, rows),
                            greedy=self.node.sampling.greedy, lengths=None if min(lengths) == k else lengths)
        tokens, probs = [], []
        for i, (b, a) in enumerate(zip(rows, n_acc)):
            seq[b, n[b] + a] = nxt[i]
            tokens.append(drafts[i, :a].tolist() + [nxt[i]])
            probs.append(p[i, :a + 1])
            if lengths[i]:
                self.stats.count(self.ids[b], lengths[i], a)
            else:
                self.stats.step(self.ids[b])
        self.logprobs = None if raw is None else [raw[i, :a + 1] for i, a in enumerate(n_acc)]
        return tokens, probs

    def _step(self, seq, n, gen, rows):
        """A round without drafts: one token a row from the node's own distribution (a Drafter's round)."""
        p = self.node.probs(seq, n, rows=rows)[:, 0]  # (R, V)
        tokens = host(sample(p, pick(gen, rows), self.node.sampling.greedy))
        for b, t in zip(rows, tokens):
            seq[b, n[b]] = t
            self.stats.step(self.ids[b])
        self.logprobs = list(self.node.logprobs[:, :1]) if self.node.raw else None
        return [[t] for t in tokens], list(p[:, None])
