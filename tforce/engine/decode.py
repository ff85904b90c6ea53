"""The decode loop over a Session's rows: one loop for one prompt (engine.generate, Conversation.ask: one
row) and for a batch (batch.generate_batch: a row per prompt); each row's statistics are statistics.py's.

The first token of each row from the prefill (Session.round), then rounds of the top level until every
row has its token budget, an EOS (kept) or its stop string (`until`,
stops.StopStrings.cut); each row's tokens are cut where they would be alone (stops.end_of_round). A row
that finishes while others go on is compacted away (Session.keep), so it costs no further work; the last
rows to finish stay where they are (a conversation's one row goes on to the next question).
"""
from __future__ import annotations

import torch

from .. import threads
from .statistics import acceptance
from .stops import end_of_round


def decode(session, n: list[int], max_new: list[int], gen: torch.Generator, eos: set[int], until=None,
           on_tokens=None, on_row=None, on_round=None) -> list[list[int]]:
    """Each prompt r's new tokens after session.buffer[i, :n[r]] (live row i is prompt session.ids[i]), at
    most max_new[r]. on_tokens(r, tokens) after each round, for every row that took part, with its new
    tokens (as cut), then on_round({r: tokens} of those rows); on_row(r, tokens) with a row's final tokens
    once it is finished (a row with no budget before the first round), so a caller keeps what is done if
    the rest fails."""
    out: list[list[int]] = [[] for _ in n]
    n = list(n)
    if not _finish(session, out, [m == 0 for m in max_new], on_row):
        return out
    while True:
        threads.tick()
        ids = list(session.ids)
        news = session.round([n[r] for r in ids], gen)
        done, told = [], {}
        for r, tokens in zip(ids, news):
            tokens = tokens[: max_new[r] - len(out[r])]
            end = end_of_round(out[r], tokens, eos, until)
            if end is not None:
                tokens = tokens[:end]
            out[r] += tokens
            n[r] += len(tokens)
            if on_tokens:
                on_tokens(r, tokens)
            told[r] = tokens
            done.append(end is not None or len(out[r]) >= max_new[r])
        if on_round:
            on_round(told)
        if not _finish(session, out, done, on_row):
            return out


def _finish(session, out: list[list[int]], done: list[bool], on_row) -> bool:
    """Tell on_row the final tokens of the live rows marked done and compact them away while others remain;
    False when none remains."""
    if not any(done):
        return True
    if on_row is not None:
        for i, d in enumerate(done):
            if d:
                on_row(session.ids[i], list(out[session.ids[i]]))
    if all(done):
        return False
    session.keep([i for i, d in enumerate(done) if not d])
    return True


def decode_one(session, n: int, max_new: int, gen: torch.Generator, eos: set[int], on_token=None, on_round=None,
               until=None) -> list[int]:
    """decode for a one-row session (engine.generate, Conversation.ask): on_token(tokens) with each round's
    tokens, then on_round(tokens, acceptance so far per level)."""
    def told(r, tokens):
        if on_token:
            on_token(tokens)
        if on_round:
            on_round(tokens, acceptance(session))

    return decode(session, [n], [max_new], gen, eos, until, told if on_token or on_round else None)[0]
