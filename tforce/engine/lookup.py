"""LookupLevel: prompt-lookup drafting, a model-free bottom level of the hierarchy (levels.py) in place of a
small draft model: SpecLevel(LookupLevel(...), full, gamma) is exact prompt-lookup decoding. Each row's
drafts are what followed the latest earlier occurrence of its last n tokens (ngram.py), over its prompt,
what it generated and the drafts of this proposal before them.

Exactness: a token chosen without sampling is a draw from the one-hot distribution on it, and goes up
labelled so. Speculative sampling (speculative.verify, as it is) then accepts draft x with probability
min(1, p(x) / 1) = p(x) and on rejection draws from normalise(max(0, p - onehot(x))), p without x; at
temperature 0 it keeps x iff x is p's argmax. The tokens are the target's whatever was proposed: a poor
guess costs acceptance only.

Each row drafts its own number of tokens, at most k (draft_lengths): what its lookups give in a row (a
continuation cut short by the sequence's end is followed by another lookup after it, which continues a
repeated run) up to where one finds nothing. SpecLevel.round drafts the most any row has and verifies each
row's own (speculative.verify's lengths), so a forward spans only what some row matched; a row whose last
tokens occur nowhere earlier drafts nothing and takes one token from the level above's own distribution.
Level.propose's rectangle is filled after a row's drafts with its last token again, never verified.

How many drafts (threshold > 0): each row keeps, per n-gram size, the chance that a token its matches of
that size proposed came, given the ones before it came (Record: judged against the row's tokens as they
come, whether drafted or not, lately); a match drafts its first L tokens, the most whose chance of all coming
(chance ** L) is at least `threshold`. A drafted position costs the level above one more position in its
forward and is worth a token when it is kept, so the threshold to set is what a position costs beside a
one-token forward: a 1-gram on prose, seldom right, drafts one token or none; a repeated passage drafts
all k. The decision reads only the row's past tokens, so each row stays an exact sample (as any draft length
chosen from the past does), and a row decides alone what it decides in a batch.

Each row keeps its n-gram index across calls and follows the shared buffer (NgramIndex.follow: a comparison
of what it holds, then a rollback past rejected drafts), as a Node follows it with its cache; no host sync:
the buffer is on the host.
"""
from __future__ import annotations

import torch

from .levels import Level
from .ngram import NgramIndex
from ..transfer import to_device


DECAY = 0.9  # a judgement's weight in a Record falls by this at each later proposal of its size: ~10 count
PRIOR = 0.5  # a size's chance before any judgement (half of one pseudo-token)


class Record:
    """One row's record of its matches: per n-gram size, decayed counts of the proposed tokens that came
    (each after the ones before it came) and of the proposals that stopped at a wrong token, and the
    proposal of that size waiting for its judgement."""

    def __init__(self, sizes):
        self.came, self.missed = dict.fromkeys(sizes, 0.0), dict.fromkeys(sizes, 0.0)
        self.waiting: dict[int, list] = {}  # size -> [position, proposal, its tokens counted so far]

    def expect(self, at: int, size: int, proposal: list[int]) -> None:
        """A match's proposal at position `at`, judged by the tokens that come there (unless one of its size
        waits); the older judgements of its size weigh DECAY less."""
        if size not in self.waiting:
            self.came[size] *= DECAY
            self.missed[size] *= DECAY
            self.waiting[size] = [at, proposal, 0]

    def judge(self, tokens) -> None:
        """Count the tokens of each waiting proposal that came since the last call, as far as the row's tokens
        reach (so a size's chance moves while a long proposal is still coming); a proposal is decided at its
        first wrong token (a miss) or once all of it came; a rollback to before it drops it."""
        for size, (at, proposal, counted) in list(self.waiting.items()):
            seen = tokens[at:at + len(proposal)].tolist()
            run = next((i for i, (a, b) in enumerate(zip(seen, proposal)) if a != b), len(seen))
            self.came[size] += max(run - counted, 0)
            self.waiting[size][2] = max(run, counted)
            if run < len(seen):
                self.missed[size] += 1
            if run < len(seen) or len(seen) == len(proposal) or not seen:
                del self.waiting[size]

    def chance(self, size: int) -> float:
        """The chance, lately, that a token a match of this size proposes comes, given the ones before it came
        (tokens that came over tokens judged: a geometric run's estimate)."""
        return (self.came[size] + PRIOR) / (self.came[size] + self.missed[size] + 1)

    def length(self, size: int, k: int, threshold: float) -> int:
        """The most drafts, up to k, whose chance of all coming is at least `threshold`."""
        chance, n = self.chance(size), 0
        while n < k and chance ** (n + 1) >= threshold:
            n += 1
        return n


class LookupLevel(Level):
    def __init__(self, vocab_size: int, device: torch.device | str, rows: int = 1, n_max: int = 3, n_min: int = 1,
                 threshold: float = 0.0):
        """vocab_size: the width of the verifier's distributions; device: theirs (the one-hot labels are
        made there); threshold: the chance a drafted position needs (Record.length; 0: every match drafts k)."""
        self.vocab_size, self.device, self.n_max, self.n_min = vocab_size, device, n_max, n_min
        self.threshold = threshold
        self.indexes = [NgramIndex(n_max, n_min) for _ in range(rows)]  # row b's holds seq[b, :what it saw]
        self.records = [Record(range(n_min, n_max + 1)) for _ in range(rows)]
        # The labels (R, k, V), kept and rewritten in place: a fresh one at V = 128K is a 3 MB allocation
        # and fill a round (0.5-2 ms on a CPU); rewriting is the 2 R k entries that change.
        self._q: torch.Tensor | None = None
        self._set: torch.Tensor | None = None  # the ids set to 1 in it, (R, k)
        self._drafts: dict[int, tuple[int, list[int]]] = {}  # row -> (the length they follow, draft_lengths's drafts)

    def prefill(self, seq: torch.Tensor, n: list[int]) -> None:
        """Index each row's seq[b, :n[b]] before the first proposal (Session.prefill): a 100K-token prompt takes
        0.15-0.6 s (n_max 3 to 5, a busy 2-core EPYC; scripts/lookup_bench.py), else in the first round's time."""
        for b, nb in enumerate(n):
            self.indexes[b].follow(seq.numpy()[b, :nb])

    def propose(self, seq, n, k, gen, rows):
        """k tokens a row: its drafts (draft_lengths's, asked just before), then a filler (_fill)."""
        tokens = torch.tensor([self._fill(b, seq, n[b], k) for b in rows], dtype=torch.long)  # (R, k)
        for b, t in zip(rows, tokens):
            seq[b, n[b]:n[b] + k] = t
        return tokens, self._labels(to_device(tokens, self.device))

    def _labels(self, ids: torch.Tensor) -> torch.Tensor:
        """One-hot (R, k, V) on ids (R, k), valid until the next proposal (SpecLevel.round verifies with it
        before it asks again)."""
        R, k = ids.shape  # k varies by round (draft_lengths): the buffer holds the most asked, used in part
        if self._q is None or self._q.shape[0] < R or self._q.shape[1] < k:
            self._q = torch.zeros(max(R, len(self.indexes)), k, self.vocab_size, device=self.device)
        else:
            self._q[:len(self._set), :self._set.shape[1]].scatter_(2, self._set[..., None], 0.0)
        self._set = ids
        return self._q[:R, :k].scatter_(2, ids[..., None], 1.0)

    def _fill(self, b: int, seq: torch.Tensor, n: int, k: int) -> list[int]:
        """Row b's k tokens: its drafts, then the last token its index holds again (never verified:
        SpecLevel.round)."""
        at, drafts = self._drafts.pop(b)
        assert at == n and len(drafts) <= k, "propose follows draft_lengths at the same position"
        return drafts + [int(self.indexes[b].tokens[-1])] * (k - len(drafts))

    @staticmethod
    def _chain(index: NgramIndex, k: int) -> list[int]:
        """Up to k tokens from lookups in a row, each after the last; the index holds them after."""
        out: list[int] = []
        while len(out) < k and (got := index.propose(k - len(out))):
            index.extend(got)
            out += got
        return out

    def draft_lengths(self, seq: torch.Tensor, n: list[int], k: int, rows: list[int]) -> list[int]:
        """How many drafts, at most k, each listed row has worth verifying (SpecLevel.round): the tokens its
        lookups give in a row (_chain), none where its last tokens occur nowhere earlier; with a threshold, as
        many as matches of that size have lately earned (Record.length). The drafts wait for propose."""
        out = []
        for b in rows:
            index = self.indexes[b]
            index.follow(seq.numpy()[b, :n[b]])  # numpy's slice: a tenth of torch's
            found = index.match()
            drafts = self._chain(index, k) if found is not None else []
            if self.threshold > 0:  # judge the waiting proposal, expect the new one, cut it to its size's length
                record = self.records[b]
                record.judge(index.tokens[:n[b]])
                if found is not None:
                    record.expect(n[b], found[0], drafts)
                    drafts = drafts[:record.length(found[0], k, self.threshold)]
            self._drafts[b] = (n[b], drafts)
            out.append(len(drafts))
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
        self._drafts = {}
