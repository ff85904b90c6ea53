"""The decode loop over a Session's rows: one loop for one prompt (engine.generate, Conversation.ask: one
row) and for a batch (batch.generate_batch: a row per prompt); each row's statistics are statistics.py's.

The first token of each row from the prefill (Session.round), then rounds of the top level until every
row has its token budget, an EOS (kept) or its stop string (`until`,
stops.StopStrings.cut); each row's tokens are cut where they would be alone (stops.take). A row
that finishes while others go on is compacted away (Session.keep), so it costs no further work; the last
rows to finish stay where they are (a conversation's one row goes on to the next question).
"""
from __future__ import annotations

import torch

from .events import Events
from .statistics import acceptance, level_counts
from .stops import take


def decode(session, n: list[int], max_new: list[int], gen: torch.Generator, eos: set[int],
           events: Events = Events()) -> list[list[int]]:
    """Each prompt r's new tokens after session.buffer[i, :n[r]] (live row i is prompt session.ids[i]), at
    most max_new[r], telling `events` (events.py) as it goes: on_tokens for every row that took part in a
    round, with its new tokens (as cut), then on_round; on_row with a row's final tokens once it is finished
    (a row with no budget before the first round), so a caller keeps what is done if the rest fails."""
    out: list[list[int]] = [[] for _ in n]
    n = list(n)
    if not _finish(session, out, [m == 0 for m in max_new], events.on_row):
        return out
    while True:
        if events.on_step:
            events.on_step()
        ids = list(session.ids)
        news = session.round([n[r] for r in ids], gen)
        done, told = [], {}
        for r, tokens in zip(ids, news):
            tokens, finished = take(out[r], tokens, max_new[r], eos, events.until)
            n[r] += len(tokens)
            if events.on_tokens:
                events.on_tokens(r, tokens, acceptance(session, r))
            told[r] = tokens
            done.append(finished)
        if events.on_round:
            events.on_round(told, level_counts(session))
        if not _finish(session, out, done, events.on_row):
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

