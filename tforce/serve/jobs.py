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
    ("text", str), ("done", text, Done) or ("error", ApiError), from the worker's thread."""

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
    """A file for TextStream: each piece of text written becomes a ("text", piece) event."""

    def __init__(self, post: Callable):
        self.post = post

    def write(self, text: str) -> None:
        self.post(("text", text))

    def flush(self) -> None:
        pass
