"""The n-gram matcher of prompt-lookup drafting (lookup.py), over one row's tokens: the tokens that followed
the latest earlier occurrence of the row's last n tokens, for the longest n from n_max down to n_min that
has one; none when no n has.

Which occurrence: the latest, as llama.cpp's ngram-simple (transformers' prompt lookup and vLLM's ngram
proposer take the earliest). Text that repeats itself (a loop in the output, code being rewritten, a
document's recurring lines) repeats what it wrote last; and the latest is the index's one read (below).
Either choice is exact: only the acceptance differs.

The continuation stops at the sequence's end: an occurrence near the end (an overlapping one, as in a run
of one token) proposes only the tokens that exist; the caller may look up again after them (lookup.py).

The index, per n: prev[e], for each end e (the n tokens ending at e are tokens[e - n:e]), is the end of the
previous occurrence of those n tokens (-1: none), and `last` maps each n-gram to its latest end. The lookup
at length L is prev[L], O(1). Appending a token adds one n-gram per n; a rollback walks the removed ends
back, restoring `last` from prev, so a rejection costs the tokens removed, not the sequence. A long append
(a prompt) is indexed by numpy sorts, into the same arrays.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

BULK = 64  # more tokens than this are appended (or rebuilt after a rollback) by numpy sorts, not one by one


class NgramIndex:
    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.sizes = range(n_max, n_min - 1, -1)  # the lookup's order: longest first
        self.length = 0
        self._tokens = np.zeros(1024, dtype=np.int64)  # the first `length` are the sequence's
        # Python lists and ints, not numpy's scalars: a decode step's few updates are a dozen element reads
        self._prev: dict[int, list[int]] = {n: [-1] for n in self.sizes}  # prev[n][e] for e = 0..length
        self._last: dict[int, dict[bytes, int]] = {n: {} for n in self.sizes}  # an n-gram's bytes -> latest end

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[:self.length]

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the sequence (fewer where the continuation reaches its end; none
        without a match)."""
        found = self.match()
        return [] if found is None else self._tokens[found[1]:min(found[1] + k, self.length)].tolist()

    def match(self) -> tuple[int, int] | None:
        """The longest n whose last n tokens occur earlier, and where what followed them starts; None if
        no n from n_max down to n_min has."""
        L = self.length
        for n in self.sizes:
            p = self._prev[n][L]
            if p >= 0:
                return n, p
        return None

    def follow(self, tokens: np.ndarray) -> None:
        """Hold exactly `tokens` (int64): rolled back to the prefix they share with what it holds (the
        drafts a verification rejected; all of it for another sequence), then extended. The comparison
        reads every token held, as Node.matching does: what keeps it right whoever rewrote the buffer."""
        keep = min(self.length, len(tokens))
        differ = self._tokens[:keep] != tokens[:keep]
        first = int(differ.argmax()) if keep else 0  # the first that differs; 0 also when none does
        if keep and differ[first]:
            keep = first
        self.truncate(keep)
        self.extend(tokens[keep:])

    def extend(self, tokens) -> None:
        new = np.asarray(tokens, dtype=np.int64)
        start, end = self.length, self.length + len(new)
        if end >= len(self._tokens):
            self._tokens = np.concatenate([self._tokens, np.zeros(max(end, len(self._tokens)), dtype=np.int64)])
        self._tokens[start:end] = new
        self.length = end
        if len(new) > BULK:
            for n in self.sizes:
                self._add_bulk(n, start, end)
        else:
            self._add(start, end)

    def truncate(self, length: int) -> None:
        if length >= self.length:
            return
        if self.length - length > max(length, BULK):  # indexing what stays again costs less than the walk
            kept = self._tokens[:length].copy()
            self.length = 0
            for n in self.sizes:
                self._prev[n], self._last[n] = [-1], {}
            self.extend(kept)
            return
        top = self.sizes[0]
        for e in range(self.length, length, -1):  # the removed ends, latest first
            grams = self._tokens[max(e - top, 0):e].tobytes()  # the longest ending at e; the others end it
            for n in self.sizes:
                if e < n:
                    continue
                key, p = grams[-8 * n:], self._prev[n][e]
                if p < 0:
                    del self._last[n][key]
                else:
                    self._last[n][key] = p
        for prev in self._prev.values():
            del prev[length + 1:]
        self.length = length

    def _add(self, start: int, end: int) -> None:
        """Index the n-grams ending at start + 1..end, one end at a time."""
        top = self.sizes[0]
        for e in range(start + 1, end + 1):
            grams = self._tokens[max(e - top, 0):e].tobytes()
            for n in self.sizes:
                prev, last = self._prev[n], self._last[n]
                if e < n:
                    prev.append(-1)
                    continue
                key = grams[-8 * n:]
                prev.append(last.get(key, -1))
                last[key] = e

    def _add_bulk(self, n: int, start: int, end: int) -> None:
        """_add for one n by sorting: equal n-grams side by side in order of position (lexsort is stable),
        each one's previous is its neighbour, or for the first of its kind here what `last` held before."""
        first = max(start + 1, n)  # the first end an n-gram has
        prev = [-1] * (min(first, end + 1) - start - 1)
        if first <= end:
            grams = sliding_window_view(self._tokens[first - n:end], n)  # row i: the n-gram ending at first + i
            keys = np.ascontiguousarray(grams).view(np.dtype((np.void, 8 * n))).ravel().tolist()  # _add's bytes
            order = np.lexsort(grams.T)
            same = (grams[order[1:]] == grams[order[:-1]]).all(1)
            found = np.full(len(keys), -1, dtype=np.int64)
            found[order[1:][same]] = order[:-1][same] + first
            last = self._last[n]
            if last:  # else (a prompt) nothing came before
                firsts = np.flatnonzero(found < 0)
                found[firsts] = [last.get(keys[i], -1) for i in firsts.tolist()]
            prev += found.tolist()
            last.update(zip(keys, range(first, end + 1)))
        self._prev[n] += prev
