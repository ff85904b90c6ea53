"""Joining: rows that join a running Session between rounds and leave it when done (a server's continuous
batching, serve/batch.py). The Session holds a fixed number of rows (its memory plan's); a prompt joins in
a free row (Session.admit: prefilled alone, but for a prefix a live row holds, whose K/V are copied; its
first token drawn from that prefill), every live row then
takes part in each round as a batch's rows do (decode.py), and a finished or dropped row is compacted away
(Session.keep), freeing its row for the next prompt.

Each row is what its prompt gives alone: greedy, its tokens (where no near-tie falls within a batched
forward's rounding: docs/batches.md); sampled, the same distribution, and with a generator of its own
(a request's seed) the same draw (tests/engine/test_joining.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .sampling import RowGenerators
from .statistics import acceptance
from .stops import take


@dataclass
class Row:
    """A joined prompt: its budget, where it ends (`until`: stops.StopStrings.cut, or None), its tokens."""
    prompt_len: int
    max_new: int
    until: Callable[[list], int | None] | None = None
    reused: int = 0  # prompt tokens whose K/V a live row held (Session.admit)
    out: list = field(default_factory=list)
    done: bool = False
    # once finished: its acceptance per level ({"draft", "retrieval"}) and verifications (rounds that decided
    # its tokens), statistics.py's names
    stats: dict = field(default_factory=dict)


class Joining:
    def __init__(self, session, gen: torch.Generator, eos: set[int]):
        """session: open with rows free (Session.keep([]) frees them all); gen: the draws of every row joining
        without a generator of its own."""
        self.session, self.gen, self.eos = session, gen, eos
        self.gens = RowGenerators()  # each live row's
        self.rows: dict[int, Row] = {}  # the live rows, by the session's prompt index (Session.admit's r)
        self.done: dict[int, Row] = {}  # finished rows, by r, until the caller pops them

    @property
    def free(self) -> int:
        """Rows a prompt can still join in."""
        return len(self.session.buffer) - len(self.session.ids)

    def join(self, prompt: list[int], max_new: int, until=None, gen: torch.Generator | None = None
             ) -> tuple[int, list[int], bool]:
        """Prefill a prompt into a free row (max_new >= 1): (its index r, its first token(s) as kept, whether
        it is finished already: EOS, a stop string, a budget of one). A finished row's Row stays in `done`
        until the caller takes it. gen: the row's own generator (a request's seed: the row draws exactly what
        the prompt alone draws from it, sampling.RowGenerators), else the shared one."""
        s = self.session
        gen = self.gen if gen is None else gen
        r, reused = s.admit(prompt, gen)
        self.gens.append(gen)
        row = self.rows[r] = Row(len(prompt), max_new, until, reused=reused)
        first = [int(s.buffer[len(s.ids) - 1, len(prompt)])]
        told = self._take(row, first)
        if row.done:
            self._leave([r])
        return r, told, row.done

    def step(self) -> dict[int, tuple[list[int], bool]]:
        """One round of every live row: {r: (its new tokens as kept, whether it is finished)}; finished rows
        leave the session."""
        s = self.session
        ids = list(s.ids)
        if not ids:
            return {}
        news = s.round([self.rows[r].prompt_len + len(self.rows[r].out) for r in ids], self.gens)
        told = {}
        for r, tokens in zip(ids, news):
            row = self.rows[r]
            told[r] = (self._take(row, tokens), row.done)
        gone = [r for r in ids if self.rows[r].done]
        if gone:
            self._leave(gone)
        return told

    def drop(self, r: int) -> Row | None:
        """Prompt r leaves the session now (its client went away, the server stops): its Row (its tokens so
        far), or None if it is not here."""
        if r in self.rows:
            self._leave([r])
        return self.done.pop(r, None)

    def _take(self, row: Row, tokens: list[int]) -> list[int]:
        tokens, row.done = take(row.out, tokens, row.max_new, self.eos, row.until)
        return tokens

    def _leave(self, gone: list[int]) -> None:
        s = self.session
        for r in gone:
            row = self.done[r] = self.rows.pop(r)
            row.stats = {"acceptance": acceptance(s, r), "verifications": s.verified[r]}
        live = [i for i, r in enumerate(s.ids) if r not in gone]
        s.keep(live)
        self.gens.keep(live)
