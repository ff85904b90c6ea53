"""Where `tforce chat`'s document and questions come from (the rules are in cli/chat.py's docstring):
BOOK, stdin, a snapshot or the demo's excerpt; questions from a file, a pipe or the terminal's line editor.
Kept apart from the conversation itself (cli/chat.py), which only iterates over the questions."""
from __future__ import annotations

import itertools
import os
import select
import stat
import sys
from typing import Optional

from ..text.demo import EXCERPT, NAME
from ..errors import UsageError
from .common import decode_text, say
from .setup import read_prompt


EMPTY_DOCUMENT = "the document is empty: give BOOK (a file, '-' for stdin), pipe it on stdin, or --load-kv DIR"


def read_document(book: Optional[str], load_kv: Optional[str], demo: bool) -> tuple[Optional[str], bool]:
    """(the document's text, or None for the snapshot's prefix; whether it was read from stdin)."""
    if book is not None:
        return read_prompt(book, None, empty=EMPTY_DOCUMENT), book == "-"
    if load_kv is not None:
        return None, False
    if not sys.stdin.isatty():
        return read_prompt(None, None, empty=EMPTY_DOCUMENT), True
    if not demo:
        raise UsageError("no document: give BOOK (a file, '-' for stdin), pipe it on stdin, or --load-kv DIR")
    say(f"tforce: no document given: using {NAME}")
    return EXCERPT.read_text(encoding="utf-8").strip(), False


def question_source(questions: Optional[str], document_on_stdin: bool, saving: bool = False):
    """(an iterator of questions (stripped, non-empty), whether they come from a terminal: then after a `> `
    prompt). A questions file or stdin stream without one is refused unless the chat is `saving` a snapshot."""
    if questions == "-" and document_on_stdin:
        raise UsageError("the document came on stdin: give the questions in a file (--questions FILE)")
    if questions is not None and questions != "-":
        try:
            data = open(os.path.expanduser(questions), "rb").read()
        except OSError as e:
            raise UsageError(f"cannot read questions file {questions}: {e.strerror or e}") from e
        lines = [q.strip() for q in decode_text(data, f"questions file {questions}").splitlines() if q.strip()]
        if not lines and not saving:
            raise UsageError(f"questions file {questions} holds no questions (one a line)")
        return iter(lines), False
    if document_on_stdin:
        try:  # the terminal becomes stdin, so that readline edits the questions
            fd = _open_terminal()
        except OSError:
            raise UsageError("the document came on stdin, so the questions cannot: give them with --questions "
                             "FILE (or run from a terminal)") from None
        os.dup2(fd, 0)
        os.close(fd)
        sys.stdin = open(0, closefd=False, encoding="utf-8", errors="replace")
    if sys.stdin.isatty():
        return _terminal_questions(), True
    lines = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else (q.encode() for q in sys.stdin)
    asked = (q for q in (decode_text(b, "stdin").strip() for b in lines) if q)
    if saving:  # the snapshot is the point: no question is needed, none is waited for
        return asked, False
    if not _readable_now(sys.stdin):
        # a program that sends its questions only after the "prefilled" line: waiting here would deadlock it,
        # so an empty stream is found (and refused the same way) after the prefill
        return _at_least_one(asked), False
    first = next(asked, None)  # already there (a file, a pipe's whole line or end): refused before the prefill
    if first is None:
        raise UsageError(NO_QUESTIONS)
    return itertools.chain((first,), asked), False


NO_QUESTIONS = "stdin holds no questions (one a line): pipe them, or give --questions FILE"


def _readable_now(stream) -> bool:
    """Whether reading `stream`'s first question now returns at once: a file, or a pipe that holds a whole
    non-blank line or whose writer has closed it (a question's first part would be waited on; blank lines
    before it, skipped anyway, are read here). A stream with no descriptor (a test's) counts as ready."""
    try:
        while select.select([stream], [], [], 0)[0]:
            if stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
                return True
            held = stream.buffer.peek(1)  # one read, which select says does not wait; nothing is consumed
            if held.strip():
                return b"\n" in held.lstrip()
            if not held:  # closed
                return True
            stream.buffer.read(len(held))  # blank so far: dropped from the buffer, as reading skips it
    except (OSError, ValueError, AttributeError):
        return True
    return False


def _at_least_one(asked):
    """`asked`, refused with NO_QUESTIONS when it ends before its first question."""
    any_asked = False
    for q in asked:
        any_asked = True
        yield q
    if not any_asked:
        raise UsageError(NO_QUESTIONS)


def _open_terminal() -> int:
    return os.open("/dev/tty", os.O_RDWR)


def _terminal_questions():
    import readline  # noqa: F401  (input() then edits the line and keeps an in-session history)

    while True:
        shown = sys.stdout if sys.stdout.isatty() else sys.stderr  # the prompt is not data: never on a file
        try:
            if shown is sys.stdout:
                line = input("> ").strip()
            else:
                sys.stderr.write("> ")
                sys.stderr.flush()
                line = input().strip()
        except EOFError:
            sys.stderr.write("\n")
            return
        except KeyboardInterrupt:  # as a shell does: the line typed so far is dropped, a fresh prompt comes
            shown.write("\n")
            shown.flush()
            continue
        if line:  # a Latin-1 terminal's bytes come as lone surrogates: read as piped questions are
            yield decode_text(line.encode("utf-8", "surrogateescape"), "the question")
