"""The speculation hierarchy of levels.py for a batch of rows (batch.py): the same composition, a row
dimension everywhere.

A RowsNode is one network with one batched cache (cache/full.py, cache/offload.py, cache/streaming.py,
cache/retrieval.py) and a host record of the tokens each row's cache holds. Asked for distributions
after each row's sequence, it rolls every row back to the longest prefix it holds that still matches
that row's sequence (levels.Node.sync, per row) and feeds every row the rest in one forward, padded at
the end to the longest (the row rule of docs/architecture.md).

RowsDrafter and RowsSpecLevel are levels.Drafter and levels.SpecLevel with per-row acceptance: every
row's yielded tokens are labelled with the verifying node's distribution (the accepted tokens and the
residual or bonus token alike), so each row is an exact sample of that node's distribution and the level
is a proposer for the level above. A level proposing k tokens repeats its rounds until every row has k;
a row that has them already goes on drafting from its first k tokens (its results are dropped and not
counted), so no cache runs further ahead than levels.Level.propose lets it in the single-prompt path.
Host syncs per round: one per drafted token for all rows (the sampled tokens join the host-side
sequences), one per verification for all rows (speculative.verify).
"""
from __future__ import annotations

import torch

from .config import Sampling
from .sampling import sample, to_probs
from .levels import REBUILD_WINDOW
from .speculative import verify
from .sync import host, to_device
from .vocab import SharedVocabulary


class RowsNode:
    def __init__(self, name: str, model, cache, sampling: Sampling, prefill_chunk: int,
                 vocab: SharedVocabulary | None = None):
        self.name, self.model, self.cache, self.sampling, self.vocab = name, model, cache, sampling, vocab
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.record: list[list[int]] = [[] for _ in range(cache.rows)]  # row i holds record[i][:lengths[i]]

    def held(self, i: int) -> int:
        return int(self.cache.lengths[i])

    def matching(self, i: int, seq: list[int], limit: int) -> int:
        """How many of the tokens row i's cache holds match seq, at most `limit`."""
        m = min(self.held(i), limit)
        rec = self.record[i]
        if rec[:m] == seq[:m]:
            return m
        return next(j for j in range(m) if rec[j] != seq[j])

    def _roll_back(self, keep: list[int]) -> None:
        if any(k < self.held(i) for i, k in enumerate(keep)):
            self.cache.truncate(torch.tensor(keep))

    def sync(self, seqs: list[list[int]]) -> None:
        """Roll each row back to the prefix of its sequence but its last token that it holds."""
        self._roll_back([self.matching(i, s, len(s) - 1) for i, s in enumerate(seqs)])

    def feed(self, chunks: list[list[int]], last: int | None) -> torch.Tensor | None:
        """Row i's tokens chunks[i] after what its cache holds, padded at the end to the longest (the
        padding is never committed); probs (B, last, V) after each row's last `last` real tokens (every
        row must feed at least `last`), or None for last=None (no logits)."""
        counts = [len(c) for c in chunks]
        T = max(counts)
        ids = torch.tensor([c + [0] * (T - len(c)) for c in chunks], dtype=torch.long)  # (B, T)
        if self.vocab is not None:
            ids = self.vocab.ids(ids)
        starts = [self.held(i) for i in range(len(chunks))]
        self.cache.begin(T)
        logits = self.model(to_device(ids, self.device), self.cache, last_n=None if last else 0)  # (B, T, V)
        self.cache.commit(torch.tensor(counts))
        for i, (c, s) in enumerate(zip(chunks, starts)):
            self.record[i] = self.record[i][:s] + c
        if not last:
            return None
        pick = torch.tensor(counts)[:, None] - last + torch.arange(last)  # (B, last)
        pick = to_device(pick, logits.device)
        chosen = logits.gather(1, pick[..., None].expand(-1, -1, logits.shape[-1]))
        if self.vocab is not None:
            chosen = self.vocab.logits(chosen)
        return to_probs(chosen.reshape(-1, chosen.shape[-1]), self.sampling).view(len(chunks), last, -1)

    def hold(self, seqs: list[list[int]], refeed: tuple[int, ...] = ()) -> None:
        """Make row i hold exactly seqs[i] (rolled back to what matches, the rest fed in chunks, no
        logits); the rows in `refeed` feed their last token again (its queries were not at hand)."""
        keep = [min(self.matching(i, s, len(s)), len(s) - (i in refeed)) for i, s in enumerate(seqs)]
        self._roll_back(keep)
        while any(self.held(i) < len(s) for i, s in enumerate(seqs)):
            self.feed([s[self.held(i):self.held(i) + self.prefill_chunk] for i, s in enumerate(seqs)], None)

    def probs(self, seqs: list[list[int]], last: int = 1) -> torch.Tensor:
        """(B, last, V): row i's distributions of the next token after each of its last `last` prefixes
        of seqs[i] (levels.Node.probs per row)."""
        self.sync(seqs)
        self._roll_back([min(self.held(i), len(s) - last) for i, s in enumerate(seqs)])
        while max(len(s) - last - self.held(i) for i, s in enumerate(seqs)) > self.prefill_chunk:
            self.feed([s[self.held(i):min(self.held(i) + self.prefill_chunk, len(s) - last)]
                       for i, s in enumerate(seqs)], None)
        return self.feed([s[self.held(i):] for i, s in enumerate(seqs)], last)

    def adopt(self, i: int, seq: list[int]) -> None:
        """Row i's cache was filled outside a forward (a rebuild) to hold seq."""
        assert self.held(i) == len(seq)
        self.record[i] = list(seq)

    def keep(self, live: list[int]) -> None:
        self.cache.keep(live)
        self.record = [self.record[i] for i in live]


class RowStats:
    """Per prompt (the caller's index, rows.ids[i] for live row i): rounds, drafted, accepted, and the
    acceptance of recent rounds for rebuild decisions."""

    def __init__(self, n: int, window: int):
        self.rounds, self.drafted, self.accepted = [0] * n, [0] * n, [0] * n
        self.recent: list[list[float]] = [[] for _ in range(n)]
        self.window = window

    def count(self, r: int, gamma: int, n_accepted: int) -> None:
        self.rounds[r] += 1
        self.drafted[r] += gamma
        self.accepted[r] += n_accepted
        self.recent[r] = (self.recent[r] + [n_accepted / gamma])[-self.window:]

    def acceptance(self, r: int) -> float | None:
        return self.accepted[r] / self.drafted[r] if self.drafted[r] else None

    def low(self, r: int, below: float) -> bool:
        recent = self.recent[r]
        return len(recent) == self.window and sum(recent) / len(recent) < below


class RowsLevel:
    """Produces tokens continuing each row's sequence, each with the distribution it was drawn from."""

    def round(self, seqs, gen, active) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Per row: new tokens and their distributions (n_i, V); active[i] False: row i's round is
        dropped by the caller (not counted)."""
        raise NotImplementedError

    def propose(self, seqs: list[list[int]], k: int, gen, active) -> tuple[list[list[int]], torch.Tensor]:
        """Exactly k tokens per row, (B, k, V) their distributions."""
        tokens, probs = [[] for _ in seqs], [[] for _ in seqs]
        while min(len(t) for t in tokens) < k:
            more = [a and len(t) < k for a, t in zip(active, tokens)]
            # a row that has k tokens drafts again after its first k, dropped: no cache runs further ahead
            t, p = self.round([s + x[:k] for s, x in zip(seqs, tokens)], gen, more)
            for i in range(len(seqs)):
                if len(tokens[i]) < k:
                    tokens[i] += t[i]
                    probs[i].append(p[i])
        return [t[:k] for t in tokens], torch.stack([torch.cat(p)[:k] for p in probs])


class RowsDrafter(RowsLevel):
    def __init__(self, node: RowsNode):
        self.node = node

    def round(self, seqs, gen, active):
        p = self.node.probs(seqs)[:, 0]  # (B, V)
        tokens = host(sample(p, gen))  # one host sync per drafted token, all rows
        return [[t] for t in tokens], list(p[:, None])


class RowsSpecLevel(RowsLevel):
    def __init__(self, proposer: RowsLevel, node: RowsNode, gamma: int, ids: list[int], n_prompts: int,
                 window: int = REBUILD_WINDOW):
        self.proposer, self.node, self.gamma = proposer, node, gamma
        self.ids = ids  # live row i is prompt ids[i] (the caller's list, updated in place)
        self.stats = RowStats(n_prompts, window)

    def round(self, seqs, gen, active):
        drafts, q = self.proposer.propose(seqs, self.gamma, gen, active)
        p = self.node.probs([s + d for s, d in zip(seqs, drafts)], last=self.gamma + 1)  # (B, gamma + 1, V)
        n_acc, nxt = verify(to_device(torch.tensor(drafts), p.device), q.to(p.device), p, gen)
        tokens, probs = [], []
        for i, (d, a) in enumerate(zip(drafts, n_acc)):
            tokens.append(d[:a] + [nxt[i]])
            probs.append(p[i, :a + 1])
            if active[i]:
                self.stats.count(self.ids[i], self.gamma, a)
        return tokens, probs
