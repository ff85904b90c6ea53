"""The date a chat template wrote into a prompt, read back from the prompt's text.

Some chat templates write the day they are rendered on into the system header (Llama 3.2's "Today Date:
26 Nov 2026", through transformers' `strftime_now`). A KV snapshot's cache was computed over the date of
the day it was made, so a prompt rendered on another day no longer begins with the snapshot's tokens: a
templated chat refused it, and `run --load-kv` reused only the tokens before the date. Rendering the
template with the snapshot's date instead (prompt_format.PromptFormat's `now`) gives the prompt the cache
belongs to. The date is read from the snapshot's own tokens, so snapshots of any tforce version get it.
"""
from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from datetime import datetime
from typing import Callable, Optional

_MARK = "\x00tforce-date\x00"  # no template writes this


def pieces(render: Callable[[Callable[[str], str]], str]) -> list[str]:
    """The text the template `render` renders (as in date_in), cut at each time it writes: literal, format,
    literal, ..., literal; one piece when it writes none."""
    return render(lambda fmt: _MARK + fmt + _MARK).split(_MARK)


def date_in(render: Callable[[Callable[[str], str]], str], text: str) -> Optional[datetime]:
    """The time `text` was rendered at, where `render(strftime_now)` renders the same template text with a
    given `strftime_now` and `text` begins with one such rendering: None when the template writes no time
    or `text` is not such a rendering. The first format the template asks for that parses back (strptime)
    into a time whose rendering `text` begins with is the answer."""
    parts = pieces(render)
    if len(parts) < 3:
        return None
    pattern = "".join(re.escape(p) if i % 2 == 0 else "(.+?)" for i, p in enumerate(parts))
    found = re.match(pattern, text, re.DOTALL)
    if found is None:
        return None
    for fmt, value in zip(parts[1::2], found.groups()):
        try:  # glibc's "%-d" (no zero before the day) is read by strptime's "%d"
            when = datetime.strptime(value, re.sub(r"(%%)|%-", lambda m: m.group(1) or "%", fmt))
        except ValueError:  # a format strptime cannot read back
            continue
        if text.startswith(render(when.strftime)):
            return when
    return None


def written(render: Callable[[Callable[[str], str]], str], when: datetime) -> str:
    """What the template `render` renders (as in date_in) writes for the time `when`: each format it asks
    strftime_now for, rendered, once, in order ("05 Jan 2026" for Llama 3.2's)."""
    formats = pieces(render)[1::2]
    return ", ".join(dict.fromkeys(when.strftime(fmt) for fmt in formats))


@contextmanager
def rendered_by(strftime: Callable[[str], str]):
    """Templates rendered inside give `strftime(format)` for transformers' `strftime_now(format)`.
    transformers turns every value passed to a template into plain data, so no function can be handed to it;
    its `strftime_now` reads `datetime.now()` from its own module, which is stood in for here. Where a
    transformers version reads the time otherwise, this does nothing: templates write today's date, and
    date_in finds none in a rendering made with markers, so a snapshot of another day is refused as before.
    One render holds the stand-in at a time (a lock); a template that other code renders on another thread
    meanwhile sees it too."""
    from transformers.utils import chat_template_utils as jinja

    class _Clock:
        @staticmethod
        def now(tz=None):
            return _At()

    class _At:
        @staticmethod
        def strftime(fmt: str) -> str:
            return strftime(fmt)

    with _CLOCK:  # one stand-in at a time: two renders on two threads put back each other's, for good
        saved = getattr(jinja, "datetime", None)
        if saved is None:
            yield
            return
        jinja.datetime = _Clock
        try:
            yield
        finally:
            jinja.datetime = saved


_CLOCK = threading.RLock()
