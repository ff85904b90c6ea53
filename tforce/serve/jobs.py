"""A request's work as the worker takes it: a Job (its prompt ids, sampling and where its events go), the
Cancelled its check raises, and TextEvents, the file a TextStream writes its pieces of text to."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..config import Sampling


class Cancelled(Exception):
    """The job was cancelled (its client went away, or the server is stopping)."""


@dataclass
class Job:
    """One request's work: its prompt ids and sampling, and where its events go. post(item) delivers
    ("text", str), ("logprobs", a part of the choice's "logprobs": the tokens' whose text comes next), ("done",
    text, Done) or ("error", ApiError), from the worker's thread."""

    ids: list
    max_new: int
    sampling: Sampling
    stops: tuple
    chat: bool
    logprobs: Optional[int] = None  # Ask.logprobs: alternatives per token, None for no log-probabilities
    echo: Optional[str] = None  # Ask.echo: the prompt's text, returned before the answer
    post: Callable = lambda item: None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def check(self, *_) -> None:
        if self.cancelled.is_set():
            raise Cancelled()


class TextEvents:
    """A file for TextStream: each piece of text written becomes a ("text", piece) event. With `parts`
    (responses.LogprobParts, when log-probabilities are asked for), the tokens' log-probabilities go first as
    a ("logprobs", part) event, each token's in the event before the piece that completes its text: a token
    whose text is held back (part of a character, a possible stop string) waits for it, or for the end."""

    def __init__(self, post: Callable, tok=None, parts=None):
        self.post, self.tok, self.parts = post, tok, parts
        self.shown = ""  # the text written so far
        self.ids: list = []  # the tokens given so far
        self.waiting: list = []  # responses.entries of the last of them, whose text is not written yet

    def tokens(self, ids: list, entries: list) -> None:
        """ids are about to be added to the TextStream; entries: their log-probabilities."""
        self.ids += list(ids)
        self.waiting += entries

    def echo(self, text: str, entries: list) -> None:
        """The prompt's text before the answer's, with its tokens' log-probabilities (entries) if asked for."""
        if entries:
            self.post(("logprobs", self.parts.part(entries)))
        self.post(("text", text))

    def write(self, text: str) -> None:
        self.shown += text
        if self.waiting:
            told = len(self.ids) - len(self.waiting)
            n = 0  # how many of the waiting tokens the text written so far completes, as TextStream decodes
            while n < len(self.waiting) and self.shown.startswith(
                    self.tok.decode(self.ids[:told + n + 1], skip_special_tokens=True)):
                n += 1
            self._release(n)
        self.post(("text", text))

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        """After the TextStream's last text: the tokens still waiting (cut by a stop string, or text that
        decoding revised)."""
        self._release(len(self.waiting))

    def _release(self, n: int) -> None:
        if n:
            self.post(("logprobs", self.parts.part(self.waiting[:n])))
            self.waiting = self.waiting[n:]
