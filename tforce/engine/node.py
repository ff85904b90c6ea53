"""A Node is one network with one cache (a row per prompt) and the record of the tokens each row's cache
holds. Nodes catch up by themselves: asked for distributions after the first n[b] tokens of each row of
the shared sequence buffer, a node rolls each row back to the longest prefix it holds that still matches
the buffer (dropping rejected speculation) and feeds only the rest, the rows asked for in one forward,
padded at the end to the longest (the row rule of docs/architecture.md); the other rows are left as they
are, rolled back at their next catch-up. No object patches another's cache.

Host and device. The shared sequence buffer (B, capacity) and each node's record of its tokens live on
the host; token ids reach the device through transfer.to_device (no sync). The device -> host transfers of a
decode step all go through transfer.host: one per drafted token for all rows (Drafter.round: the tokens join
the host-side sequences that catch-up compares against) and one per verification (speculative.verify).
So a triforce round of gamma2 tokens from gamma1-token middle rounds costs about gamma2 draft syncs plus
one per middle round plus one. Keeping drafted tokens on the device until a verification would save the
draft syncs; it needs a device-side sequence buffer and a catch-up rule that does not compare token
values, not done.
"""
from __future__ import annotations

import torch

from ..config import Sampling
from .sampling import to_probs
from ..transfer import to_device
from .timing import ForwardTimer
from ..model.vocab import SharedVocabulary


class Node:
    def __init__(self, name: str, model, cache, sampling: Sampling, capacity: int, prefill_chunk: int = 512,
                 runner=None, vocab: SharedVocabulary | None = None):
        """vocab: a draft's mapping into the target's ids when its embedding table is shorter (vocab.py)."""
        self.name, self.model, self.cache, self.sampling, self.vocab = name, model, cache, sampling, vocab
        # runner(ids, last_n) replaces model(ids, cache, last_n) when given (graphs.GraphRunner, rowwise.py)
        self.runner = runner or (lambda ids, last_n: model(ids, cache, last_n=last_n))
        self.counted = getattr(runner, "counted", False)  # takes each row's real count (rowwise.py)
        self.subsets = getattr(cache, "subsets", False)  # runs forwards over some of its rows (_feed)
        self.alone_rows = getattr(cache, "alone_rows", self.subsets)  # runs one over a row alone (fill_row)
        self.tokens = torch.zeros(cache.rows, capacity, dtype=torch.long)  # row b holds tokens[b, :lengths[b]]
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.forwards = 0
        self.row_forwards = 0  # rows fed, over the forwards (a forward of R rows counts R): bench's floors
        self.timer = ForwardTimer(self.device)  # seconds in forwards, read after decoding (stage times)
        # raw: keep `logprobs`, the log-softmax of the last distributions' logits before any sampling transform
        # (what a server reports as a token's log-probability), float32 (R, k, V)
        self.raw, self.logprobs = False, None

    def held(self, b: int) -> int:
        return self.cache.lengths[b]

    def matching(self, seq: torch.Tensor, n: list[int], rows: set[int] | None = None) -> list[int]:
        """Per row, how many of the tokens its cache holds match seq[b, :n[b] - 1] (the prefix it keeps);
        with rows, only those rows' (the others: what they hold, untouched until they are asked for)."""
        out = []
        for b, nb in enumerate(n):
            if rows is not None and b not in rows:
                out.append(self.held(b))
                continue
            m = min(self.held(b), nb - 1)
            diff = (self.tokens[b, :m] != seq[b, :m]).nonzero()
            out.append(int(diff[0]) if len(diff) else m)
        return out

    def _roll_back(self, keep: list[int]) -> None:
        if any(k < self.held(b) for b, k in enumerate(keep)):
            self.cache.truncate(keep[0] if len(keep) == 1 else keep)

    def match_prefix(self, seq: torch.Tensor, n: list[int]) -> list[int]:
        """Roll each row back to the matching prefix of seq[b, :n[b]]; returns where feeding must start
        (<= n[b] - 1)."""
        keep = self.matching(seq, n)
        self._roll_back(keep)
        return keep

    def _feed(self, seq: torch.Tensor, ends: list[int], last: int, prefill: bool = False,
              want: list[int] | None = None, alone: bool = False) -> torch.Tensor | None:
        """Feed row b seq[b, held(b):ends[b]] (padded at the end to the longest; the padding is never
        committed); probs (W, last, V) after the last `last` real tokens of each row in `want` (None: every
        row; each feeds at least `last`), or None for last=0. A row feeding nothing sits the forward out
        when the cache runs forwards over some of its rows (`cache.subsets`: the draft and middle levels'
        caches); else it is fed padding. prefill: a prefill chunk (last 0 or 1; a row feeding nothing
        gets a meaningless distribution), run by the plain forward: the runners are for decode steps (a CUDA
        graph holds decode shapes; row-wise verification computes what a one-token step would), and one
        prefill forward for every method gives every method the same first token. alone: the rows feeding
        nothing sit the forward out wherever the cache allows it (fill_row)."""
        B, starts = len(ends), self.cache.lengths[:len(ends)]
        counts = [e - s for s, e in zip(starts, ends)]
        rows = list(range(B))  # the rows in the forward
        if B > 1 and (self.subsets or alone and self.alone_rows) and 0 in counts:
            rows = [b for b in rows if counts[b]]
        fed_counts = [counts[b] for b in rows]
        T = max(fed_counts)
        same = min(fed_counts) == T  # rows of one count (always one row): the forward keeps only `last` logits
        if len(rows) == 1:
            b = rows[0]
            ids = seq[b:b + 1, starts[b]:ends[b]]  # (1, T), a view
        elif same:
            ids = torch.stack([seq[b, starts[b]:ends[b]] for b in rows])  # (R, T)
        else:
            ids = torch.zeros(len(rows), T, dtype=torch.long)
            for i, b in enumerate(rows):
                ids[i, :counts[b]] = seq[b, starts[b]:ends[b]]
        fed = ids if self.vocab is None else self.vocab.ids(ids)
        if len(rows) < B:
            self.cache.begin(T, None if same else fed_counts, rows)
        else:
            self.cache.begin(T, None if same else fed_counts)
        mark = self.timer.start()
        fed = to_device(fed, self.device)
        if prefill and not (self.counted and B > 1):
            logits = self._prefill_forward(fed, fed_counts, last, same)
        elif self.counted:  # real tokens only: each row's last `last` logits (rowwise.py)
            logits = self.runner(fed, last, fed_counts, prefill)  # (R, last, V)
        else:
            logits = self.runner(fed, last if same else None if last else 0)  # (R, last or T, V)
        self.timer.stop(mark)
        self.cache.commit(T if same and len(rows) == B else counts)
        for b, (s, e) in enumerate(zip(starts, ends)):
            self.tokens[b, s:e] = seq[b, s:e]
        self.forwards += 1
        self.row_forwards += len(rows)
        if not last:
            return None
        if not same and not prefill and not self.counted:
            # (R, last); a row feeding nothing (padding only) picks position 0, never used
            pick = (torch.tensor(fed_counts)[:, None] - last + torch.arange(last)).clamp(min=0)
            pick = to_device(pick, logits.device)
            logits = logits.gather(1, pick[..., None].expand(-1, -1, logits.shape[-1]))
        if want is not None and want != rows:
            logits = logits[to_device(torch.tensor([rows.index(b) for b in want]), logits.device)]
        return self._probs(logits)

    def _prefill_forward(self, ids: torch.Tensor, counts: list[int], last: int, same: bool) -> torch.Tensor | None:
        """The plain forward of a prefill chunk; with last=1, logits (B, 1, V) after each row's last real
        token: the head runs on those positions only (a ragged chunk's full logits would be T x V per row)."""
        if not last or same:
            return self.model(ids, self.cache, last_n=last)
        h = self.model.hidden(ids, self.cache)  # (B, T, hidden)
        pick = to_device(torch.tensor(counts).clamp(min=1) - 1, h.device)
        return self.model.head(h[torch.arange(len(counts), device=h.device), pick][:, None])

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (B, k, V) in the model's ids -> the distributions (B, k, V) every level samples from."""
        if self.vocab is not None:
            logits = self.vocab.logits(logits)
        if self.raw:
            self.logprobs = torch.log_softmax(logits.float(), -1)
        B, k = logits.shape[:2]
        return to_probs(logits.reshape(-1, logits.shape[-1]), self.sampling).view(B, k, -1)

    def next_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The distribution (B, V) of each row's next token from its last position's final hidden states
        (B, 1, hidden): a prefill run outside a forward of this node's (prefill.prefill_layer_major). Row by
        row under row-wise verification: (1, 1, hidden) as each row's prefill alone computes it."""
        if self.counted:
            return self._probs(self.runner.heads(list(hidden.split(1))))[:, 0]
        return self._probs(self.model.head(hidden))[:, 0]

    def probs(self, seq: torch.Tensor, n: list[int], last: int = 1, rows: list[int] | None = None
              ) -> torch.Tensor:
        """(R, last, V): for each listed row (None: every row), its distributions of the next token after
        each of seq[b, :n[b] - last + 1], ..., seq[b, :n[b]]. The other rows are left as they are."""
        rows = list(range(len(n))) if rows is None else rows
        asked = set(rows)
        start = self.matching(seq, n, asked)
        for b in rows:
            start[b] = min(start[b], n[b] - last)
        self._roll_back(start)  # the logits of tokens it already holds are wanted: feed them again
        while max(n[b] - last - self.held(b) for b in rows) > self.prefill_chunk:  # in chunks
            self._feed(seq, [min(self.held(b) + self.prefill_chunk, nb - last) if b in asked else self.held(b)
                             for b, nb in enumerate(n)], 0)
        return self._feed(seq, [nb if b in asked else self.held(b) for b, nb in enumerate(n)], last, want=rows)

    def adopt(self, seq: torch.Tensor, lengths: list[int], rows: list[int] | None = None) -> None:
        """The listed rows' caches (None: every row) were filled outside a forward (a rebuild, a layer-major
        prefill, a snapshot) to hold seq[i, :lengths[i]] (i: the position in `rows`)."""
        for i, b in enumerate(range(len(lengths)) if rows is None else rows):
            assert self.held(b) == lengths[i]
            self.tokens[b, :lengths[i]] = seq[i, :lengths[i]]

    def prefill(self, seq: torch.Tensor, n: list[int], progress=None, refeed: tuple[int, ...] = ()) -> list[int]:
        """Make row b hold exactly seq[b, :n[b]]: rolled back to what matches, the rest fed in chunks with no
        logits; rows in `refeed` feed their last token again (its queries were not at hand). progress(done,
        total) after each chunk, in tokens of all rows. Returns how many tokens each row kept."""
        matched = self.match_prefix(seq, [x + 1 for x in n])
        kept = [min(k, nb - (b in refeed)) for b, (k, nb) in enumerate(zip(matched, n))]
        self._roll_back(kept)
        self._fill(seq, n, progress)
        return kept

    def prefill_next(self, seq: torch.Tensor, n: list[int], progress=None) -> tuple[list[int], torch.Tensor]:
        """prefill, and each row's distribution of the token after seq[b, :n[b]] (B, V), from the chunk that
        feeds its last token: every row feeds at least that one, so what the cache already holds is kept up
        to n[b] - 1. Returns (kept, the distributions)."""
        kept = self.match_prefix(seq, n)
        return kept, torch.stack(self._fill(seq, n, progress, want=True))

    def fill_row(self, seq: torch.Tensor, b: int, length: int, want: bool = False) -> torch.Tensor | None:
        """Row b, just added (cache.add_row; holding a prefix of it, or nothing), takes the rest of
        seq[b, :length] in chunks, fed alone where the cache allows it (the other rows sit out, as the same
        prompt's prefill alone: a request joining a running batch, Session.admit); with want, the distribution
        (V,) of its next token."""
        n = [self.held(i) for i in range(self.cache.rows)]
        n[b] = length
        out = self._fill(seq, n, None, want=want, alone=True)
        return out[b] if want else None

    def _fill(self, seq: torch.Tensor, n: list[int], progress, want: bool = False, alone: bool = False) -> list | None:
        """Feed every row up to n[b] in chunks of prefill_chunk; want: the next-token distribution (V,) of
        each row that reaches its n[b] (a list by row; None for the others), from the chunk that ends it."""
        out: list = [None] * len(n)
        while any(self.held(b) < nb for b, nb in enumerate(n)):
            ends = [min(self.held(b) + self.prefill_chunk, nb) for b, nb in enumerate(n)]
            ended = [b for b, (nb, e) in enumerate(zip(n, ends)) if want and self.held(b) < nb and e == nb]
            probs = self._feed(seq, ends, int(bool(ended)), prefill=True, want=ended, alone=alone)
            for i, b in enumerate(ended):
                out[b] = probs[i, 0]
            if progress:
                progress(sum(self.held(b) for b in range(len(n))), sum(n))
        return out if want else None

    def add_row(self) -> int:
        """One more live row, empty (Session.admit)."""
        return self.cache.add_row()

    def share_prefix(self, src: int, dst: int, n: int) -> None:
        """Row dst (just added) holds row src's first n tokens (cache.copy_prefix)."""
        self.cache.copy_prefix(src, dst, n)
        self.tokens[dst, :n] = self.tokens[src, :n]

    def keep(self, live: list[int]) -> None:
        """Only the listed rows stay (cache/rows.py keep), with their records."""
        self.cache.keep(live)
        self.tokens[:len(live)] = self.tokens[torch.tensor(live, dtype=torch.long)].clone()
