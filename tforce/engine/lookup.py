"""LookupLevel: prompt-lookup drafting, a model-free bottom level of the hierarchy (levels.py) in place of a
small draft model: SpecLevel(LookupLevel(...), full, gamma) is exact prompt-lookup decoding. Each row's
drafts are what followed the latest earlier occurrence of its last n tokens (ngram.py), over its prompt,
what it generated and the drafts of this proposal before them.

Exactness: a token chosen without sampling is a draw from the one-hot distribution on it, and goes up
labelled so. Speculative sampling (speculative.verify, as it is) then accepts draft x with probability
min(1, p(x) / 1) = p(x) and on rejection draws from normalise(max(0, p - onehot(x))), p without x; at
temperature 0 it keeps x iff x is p's argmax. The tokens are the target's whatever was proposed: a poor
guess costs acceptance only.

Always k tokens a row: the level above verifies exactly k per row (Level.propose; verify takes a rectangle).
A continuation cut short by the sequence's end is followed by another lookup after it (which continues a
repeated run); where that finds nothing the row guesses its last token again, a one-hot guess like any
other, and looks up again after it. A row whose last tokens occur nowhere earlier (matched) drafts nothing:
the level above takes one token from its own distribution instead of verifying k guesses
(levels.SpecLevel.round).

Which matches draft (threshold > 0): each row keeps, per n-gram size, the share of the tokens matches of
that size proposed lately that came, in a row from the first (a match's continuation, up to k tokens, judged
against the row's tokens as they come, whether it was drafted or not: Record); a match whose size's share
is under `threshold` drafts nothing that round. On prose a 1-gram matches nearly everywhere and is seldom
right, and a round of k guesses costs the level above a forward over k + 1 positions: the record stops
paying for it, and drafts again once matches of that size are right again. The decision reads only the
row's past tokens, so each row stays an exact sample (as a draft length chosen from the past does), and a
row decides alone what it decides in a batch.

Each row keeps its n-gram index across calls and follows the shared buffer (NgramIndex.follow: a comparison
of what it holds, then a rollback past rejected drafts), as a Node follows it with its cache; no host sync:
the buffer is on the host.
"""
from __future__ import annotations

import torch

from .levels import Level
from .ngram import NgramIndex
from ..transfer import to_device


DECAY = 0.9  # a judgement's weight in a Record falls by this each later one: about the last 10 count
PRIOR = 0.5  # a size's rate before any judgement (half of one pseudo-token)


class Record:
    """One row's record of its matches: per n-gram size, decayed sums of the tokens a match of that size
    proposed and of those that came, in a row from the first (the drafts a verification would have kept at
    temperature 0), and the proposal waiting for its judgement."""

    def __init__(self, sizes):
        self.came, self.proposed = dict.fromkeys(sizes, 0.0), dict.fromkeys(sizes, 0.0)
        self.waiting: tuple[int, int, list[int]] | None = None  # (position, size, proposal) being judged

    def expect(self, at: int, size: int, proposal: list[int]) -> None:
        """A match's proposal at position `at`, judged by the tokens that come there (unless one waits)."""
        if self.waiting is None:
            self.waiting = (at, size, proposal)

    def judge(self, tokens) -> None:
        """Judge the waiting proposal as far as the row's tokens now reach: decided at its first wrong token
        or once all of it came, else it waits for a later call; a rollback to before it drops it."""
        if self.waiting is None:
            return
        at, size, proposal = self.waiting
        seen = tokens[at:at + len(proposal)].tolist()
        run = next((i for i, (a, b) in enumerate(zip(seen, proposal)) if a != b), len(seen))
        if run < len(seen) or len(seen) == len(proposal):
            self.came[size] = DECAY * self.came[size] + run
            self.proposed[size] = DECAY * self.proposed[size] + len(proposal)
            self.waiting = None
        elif not seen:
            self.waiting = None

    def rate(self, size: int) -> float:
        """The share of the proposed tokens that came, lately, for matches of this size."""
        return (self.came[size] + PRIOR) / (self.proposed[size] + 1)


class LookupLevel(Level):
    def __init__(self, vocab_size: int, device: torch.device | str, rows: int = 1, n_max: int = 3, n_min: int = 1,
                 threshold: float = 0.0):
        """vocab_size: the width of the verifier's distributions; device: theirs (the one-hot labels are
        made there); threshold: the Record.rate a match's size needs to draft (0: every match drafts)."""
        self.vocab_size, self.device, self.n_max, self.n_min = vocab_size, device, n_max, n_min
        self.threshold = threshold
        self.indexes = [NgramIndex(n_max, n_min) for _ in range(rows)]  # row b's holds seq[b, :what it saw]
        self.records = [Record(range(n_min, n_max + 1)) for _ in range(rows)]
        # The labels (R, k, V), kept and rewritten in place: a fresh one at V = 128K is a 3 MB allocation
        # and fill a round (0.5-2 ms on a CPU); rewriting is the 2 R k entries that change.
        self._q: torch.Tensor | None = None
        self._set: torch.Tensor | None = None  # the ids set to 1 in it, (R, k)

    def prefill(self, seq: torch.Tensor, n: list[int]) -> None:
        """Index each row's seq[b, :n[b]] before the first proposal (Session.prefill): a 100K-token prompt takes
        0.15-0.6 s (n_max 3 to 5, a busy 2-core EPYC; scripts/lookup_bench.py), else in the first round's time."""
        for b, nb in enumerate(n):
            self.indexes[b].follow(seq.numpy()[b, :nb])

    def propose(self, seq, n, k, gen, rows):
        tokens = torch.tensor([self._draft(b, seq, n[b], k) for b in rows], dtype=torch.long)  # (R, k)
        for b, t in zip(rows, tokens):
            seq[b, n[b]:n[b] + k] = t
        return tokens, self._labels(to_device(tokens, self.device))

    def _labels(self, ids: torch.Tensor) -> torch.Tensor:
        """One-hot (R, k, V) on ids (R, k), valid until the next proposal (SpecLevel.round verifies with it
        before it asks again)."""
        R, k = ids.shape
        if self._q is None or self._q.shape[0] < R or self._q.shape[1] != k:
            self._q = torch.zeros(max(R, len(self.indexes)), k, self.vocab_size, device=self.device)
        else:
            self._q[:len(self._set)].scatter_(2, self._set[..., None], 0.0)
        self._set = ids
        return self._q[:R].scatter_(2, ids[..., None], 1.0)

    def _draft(self, b: int, seq: torch.Tensor, n: int, k: int) -> list[int]:
        index = self.indexes[b]
        index.follow(seq.numpy()[b, :n])  # numpy's slice: a tenth of torch's
        out: list[int] = []
        while len(out) < k:
            got = index.propose(k - len(out)) or [int(index.tokens[-1])]
            index.extend(got)
            out += got
        return out

    def matched(self, seq: torch.Tensor, n: list[int], k: int, rows: list[int]) -> list[bool]:
        """Whether each listed row drafts this round: its last tokens occur earlier (its proposal starts with a
        match) and matches of that size have been right often enough lately (Record). Without, its k drafts
        would be guesses, which SpecLevel.round does not verify (a round that drafts nothing)."""
        out = []
        for b in rows:
            index = self.indexes[b]
            index.follow(seq.numpy()[b, :n[b]])
            found = index.match()
            if self.threshold == 0:  # no record kept: every match drafts
                out.append(found is not None)
                continue
            record = self.records[b]
            record.judge(index.tokens)  # the row's tokens now judge the waiting proposal, if they reach it
            if found is not None:
                record.expect(index.length, found[0], index.propose(k))
            out.append(found is not None and record.rate(found[0]) >= self.threshold)
        return out

    def add_row(self, seq: torch.Tensor, b: int, length: int) -> None:
        """Row b joins (Session.admit; the live rows before it): a fresh index of seq[b, :length]."""
        assert b == len(self.indexes)
        self.indexes.append(NgramIndex(self.n_max, self.n_min))
        self.indexes[b].follow(seq.numpy()[b, :length])
        self.records.append(Record(range(self.n_min, self.n_max + 1)))

    def keep(self, live: list[int]) -> None:
        """Only the listed rows stay, moved to the front with their indexes and records (Session.keep)."""
        self.indexes = [self.indexes[i] for i in live]
        self.records = [self.records[i] for i in live]
