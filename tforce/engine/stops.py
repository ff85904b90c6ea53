"""Stop strings (`--stop`): generation ends once the decoded text holds one of them.

The tokens kept are the model's own, an exact prefix of what it generates without a stop: up to and
including the token whose text completes the first stop string. The text shown ends just before that
string, as in other inference tools (the stop string is not printed). Decoding is the tokenizer's, as
the streamed text is (`skip_special_tokens=True`), so a stop string matches the text a user sees.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, tokenizer, stops: list[str] | tuple[str, ...]):
        """stops: non-empty strings (the command line refuses an empty one)."""
        self.tok, self.stops = tokenizer, tuple(dict.fromkeys(stops))

    def __bool__(self) -> bool:
        return bool(self.stops)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def first(self, text: str) -> tuple[int, str] | None:
        """(where it begins, the string) of the stop string that ends first in text (what a reader meets
        first), or None."""
        found = [(text.find(s) + len(s), text.find(s), s) for s in self.stops if s in text]
        return min(found)[1:] if found else None

    def find(self, text: str) -> int | None:
        """Where the first stop string (first()) begins in text."""
        first = self.first(text)
        return None if first is None else first[0]

    def cut(self, ids: list[int]) -> int | None:
        """How many of ids to keep when their text holds a stop string: the fewest whose text does (the
        token completing it included); None when it holds none."""
        if not self.stops or self.find(self.decode(ids)) is None:
            return None
        lo, hi = 1, len(ids)  # the text of ids[:k] holds a stop for k = hi; find the least such k
        while lo < hi:
            mid = (lo + hi) // 2
            if self.find(self.decode(ids[:mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        return hi

    def matched(self, ids: list[int]) -> str | None:
        """The stop string that ended ids' text, if one did."""
        first = self.first(self.decode(ids))
        return None if first is None else first[1]

    def shown(self, text: str, final: bool) -> str:
        """The part of text to show: before a stop string; while generating (not final), also less a tail
        that may yet become one."""
        at = self.find(text)
        if at is not None:
            return text[:at]
        if final:
            return text
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[:len(text) - held]


def take(out: list[int], tokens: list[int], max_new: int, eos: set[int], until=None) -> tuple[list[int], bool]:
    """A round's new tokens for a row that has `out` so far, as it keeps them (cut at its budget max_new,
    then where end_of_round ends it), appended to `out`; and whether the row is finished. The one rule of
    decode.decode and joining.Joining."""
    tokens = tokens[:max_new - len(out)]
    end = end_of_round(out, tokens, eos, until)
    if end is not None:
        tokens = tokens[:end]
    out += tokens
    return tokens, end is not None or len(out) >= max_new


def end_of_round(out: list[int], tokens: list[int], eos: set[int], until=None) -> int | None:
    """Where generation ends in a round's new tokens (already cut at the budget), after `out`: after the first
    EOS (kept), or where until(out + tokens) says (generate's `until`, e.g. StopStrings.cut; it sees the
    tokens up to an EOS); None to keep them all and go on. The one rule for every row of
    decode.decode (one prompt or a batch), so that a row ends where it would alone."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
    keep = until(out + tokens[:end]) if until is not None else None
    if keep is not None:  # earlier rounds' tokens were checked: the end falls in this round's
        end = max(keep - len(out), 0)
    return end
