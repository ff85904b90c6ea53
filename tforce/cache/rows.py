"""Row bookkeeping every cache shares (the row rule of docs/architecture.md): each row's committed length on the
host (`lengths`, a list of ints: the decode loop decides acceptance on the host, so no device -> host copy is
needed to size a view, and reading one costs no tensor op), the live row count, commit, truncate, and keep
(finished rows compacted away).
One prompt is one row: `length` is then that row's count.
"""
from __future__ import annotations

import torch

from ..errors import TforceError
from .rope import Rotary


def rotation(rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype):
    """positions (B, T) -> cos, sin (B, T, 1, D), broadcasting over (B, T, H, D): per-row positions."""
    B, T = positions.shape
    cos, sin = rotary.cos_sin(positions.reshape(-1), dtype)  # (B * T, 1, D)
    return cos.view(B, T, 1, -1), sin.view(B, T, 1, -1)


def per_row(x, rows: int) -> list[int]:
    """Counts or lengths as one int per row: an int (every row), a (rows,) or 0-dim tensor, or a list."""
    if isinstance(x, int):
        return [x] * rows
    if torch.is_tensor(x):
        return x.expand(rows).tolist() if x.dim() == 0 else x.tolist()
    return [int(v) for v in x]


class Rows:
    def _init_rows(self, n_rows: int) -> None:
        self.rows = n_rows
        self.lengths = [0] * n_rows
        self.pending = 0

    def span(self) -> tuple[int, int]:
        """(shortest, longest) committed length of the live rows; equal for one row."""
        if self.rows == 1:
            return self.lengths[0], self.lengths[0]
        live = self.lengths[:self.rows]
        return min(live), max(live)

    def common(self, per_row: list[int]) -> tuple[int, int] | None:
        """(length, per_row's value) when every live row has the same of both (always, for one row): the
        fast path of docs/architecture.md; else None."""
        if self.rows == 1:
            return self.lengths[0], per_row[0]
        lengths, values = self.lengths[:self.rows], per_row[:self.rows]
        if min(lengths) == max(lengths) and min(values) == max(values):
            return lengths[0], values[0]
        return None

    @property
    def length(self) -> int:
        """The committed length every live row shares (one row's count; rows of different lengths have none)."""
        lo, hi = self.span()
        assert lo == hi, "rows of different lengths have no common length"
        return lo

    def commit(self, counts) -> None:
        """Row b keeps the first counts[b] of the pending tokens (counts: one per row, or an int for all)."""
        counts = per_row(counts, self.rows)
        assert all(0 <= n <= self.pending for n in counts)
        for b, n in enumerate(counts):
            self.lengths[b] += n
        self.pending = 0

    def truncate(self, lengths) -> None:
        """Drop committed tokens from the rows' ends: row b keeps lengths[b] (an int: every row), at most what
        it holds."""
        keep = per_row(lengths, self.rows)
        assert all(0 <= k <= n for k, n in zip(keep, self.lengths))
        self.lengths[:self.rows] = keep

    def keep(self, rows: list[int]) -> None:
        """Keep only the listed live rows (increasing), moved to the front in that order (finished rows cost
        nothing after this). Each row that moves is copied in place, row i to row j < i, only the slots it
        uses: no scratch memory (placement.py plans none), and no copy of a row's unused tail."""
        assert all(a < b for a, b in zip(rows, rows[1:])), "keep takes live rows in increasing order"
        for j, i in enumerate(rows):
            if i != j:
                self._move_row(i, j)
        self.lengths[:len(rows)] = [self.lengths[i] for i in rows]
        self.rows = len(rows)

    def add_row(self) -> int:
        """One more live row, empty, after the live ones (a request joining a running batch:
        Session.admit); returns its index. Its slots may hold a finished row's K/V: nothing reads a slot
        before a forward writes it."""
        b = self.rows
        if b >= len(self.lengths):
            raise TforceError(f"the cache has no free row ({len(self.lengths)} rows)")
        self.rows += 1
        self.lengths[b] = 0
        self._reset_row(b)
        return b

    def _reset_row(self, b: int) -> None:
        """A cache's own per-row state for a row that starts empty (add_row)."""

    def _used(self, b: int) -> int:
        """Slots row b uses (its committed tokens)."""
        return self.lengths[b]

    def _move_row(self, i: int, j: int) -> None:
        """Row i's K/V (every layer) and per-row state go to row j (j < i: row j's are no longer needed)."""
        n = self._used(i)
        self.k[:, j, :n] = self.k[:, i, :n]
        self.v[:, j, :n] = self.v[:, i, :n]
