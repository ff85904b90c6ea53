"""`tforce chat`: a document prefilled once, then questions about it, each answer streamed to stdout.

Where things come from:
- the document: BOOK ('-' = stdin); without BOOK, a snapshot's prefix (--load-kv), else text piped on
  stdin, else (no --model either) the demo's excerpt;
- the questions (read by cli/chat_input.py), one per line (blank lines skipped): --questions FILE ('-' =
  stdin); else stdin, unless the document came on stdin: then the terminal (/dev/tty), and without one a
  usage error. A questions file or piped stream with no question is a usage error (unless --save-kv:
  the snapshot is then the point), before any weights are read when the stream's first line or end is
  already there; else the prefill comes first, as a program driving chat may wait for the "prefilled"
  line before it asks. When the
  questions come from a terminal, they are read with a line editor (Python's readline: arrows, in-session
  history) after a `> ` prompt. There Ctrl-C stops the answer being written (the text so far stays; the
  question and its partial answer do not join the history) or drops the line being typed, and a fresh
  `> ` prompt comes; Ctrl-D ends the chat. With questions from a file or a pipe, and while the document
  is prefilled, Ctrl-C ends tforce (exit 130).
With --tp N (--gpus N) the target is split over N persistent rank processes that prefill the document
once and answer every question (tforce/parallel/conversation.py); they end with the chat.
Each question's tokens (a blank line and the question, in the model's chat template when its tokenizer
has one: tforce/text/format.py) are appended to the document's; the answer is the target's exact
continuation (tforce/engine/conversation.py). Answers go to
stdout, each ended by a newline (--json: one object per question per line, "interrupted": true for an answer
stopped by Ctrl-C); the live status, the prompt and each answer's time to first token go to stderr.
"""
from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from typing import Optional

import typer

from .. import threads
from ..errors import UsageError
from ..engine.events import Events
from ..engine.stops import StopStrings
from . import options as o
from .app import app
from .chat_input import read_document, question_source
from .common import check_memory, guarded, say, flag
from ..text.stream import TextStream
from .live import Progress, Status, text_progress
from .run import end_line
from .setup import configure, read_draft_config, dtype_bytes, notices

ROOM = 4096  # tokens after the document, by default


@app.command()
@o.shared()
def chat(
    book: Optional[str] = typer.Argument(None, metavar="[BOOK]", help="Document to read ('-' = stdin)."),
    questions: Optional[str] = typer.Option(None, "--questions", "-q", metavar="FILE",
                                            help="Questions, one per line ('-' = stdin; default: stdin, or the "
                                                 "terminal when the document comes on stdin)."),
    keep_history: bool = flag("--keep-history", "Each question follows the earlier questions and answers "
                                                "(default: each follows the document alone)."),
    room: Optional[int] = typer.Option(None, "--room", help=f"Tokens after the document for a question and its "
                                       f"answer (with --keep-history, the whole conversation; default {ROOM}, or "
                                       "what the model's context leaves)."),
    as_json: bool = flag("--json", "One JSON object per question (question, answer, tokens, stats) per line."),
    opts: Optional[dict] = None,
) -> None:
    """Ask questions about a document, which is prefilled once (or loaded from a KV snapshot)."""
    params = {**opts, **{k: v for k, v in locals().items() if k != "opts"}}
    save_kv, load_kv = opts["save_kv"], opts["load_kv"]

    def body():
        if room is not None and room < 2:
            raise UsageError(f"--room must be >= 2, got {room}")
        setup = configure(params, calibrate=False)
        text, from_stdin = read_document(book, load_kv, opts["model"] is None)
        lines, from_terminal = question_source(questions, from_stdin, save_kv is not None)
        with ExitStack() as ranks:  # tensor-parallel ranks end with the chat, however it ends
            _chat(text, lines, from_terminal, setup, room, keep_history, as_json, save_kv, load_kv, ranks)

    guarded(body)


def _chat(text: Optional[str], questions, from_terminal: bool, setup, room: Optional[int], keep_history: bool,
          as_json: bool, save_kv: Optional[str], load_kv: Optional[str], ranks: ExitStack) -> None:
    from ..engine.generate import eos_ids
    from ..snapshot.format import read_manifest

    path, model_config, tok = setup.target_files()
    saved = None if load_kv is None else read_manifest(load_kv)["tokens"]  # the snapshot's token ids
    fmt = setup.prompt_format(tok, path, saved)
    if keep_history:
        fmt.check_history()
    if text is not None:
        doc = fmt.document_ids(text)
    else:
        doc = saved
        fmt.check_document(doc, f"the KV snapshot {load_kv}")
    context = model_config.max_position_embeddings
    if len(doc) + 2 > context:
        raise UsageError(f"the document is {len(doc)} tokens; the model's context ({context}) leaves no room "
                         "for a question")
    notices(setup, fmt)
    if room is not None and room > context - len(doc):  # the default is cut without a word
        say(f"tforce: note: the model's context ({context} tokens) leaves room for {context - len(doc)} tokens of "
             f"questions and answers after the {len(doc)}-token document, not the --room {room} asked for")
    room = min(ROOM if room is None else room, context - len(doc))
    config = setup.config  # with the snapshots (--load-kv, --save-kv) of the document
    max_new, method = config.max_new_tokens, config.method
    live = sys.stderr.isatty() and not as_json
    progress = Progress(Status([len(doc)], [0], method), f"tforce {method}") if live else None
    try:
        conv = _conversation(setup, path, model_config, tok, doc, ranks, room=room, keep_history=keep_history,
                             on_prefill=progress.on_prefill if progress else None)
    finally:
        if progress:
            progress.close()
    how = f" ({conv.kv_reused} loaded from {load_kv}, {len(doc) - conv.kv_reused} prefilled)" \
        if load_kv is not None else " prefilled"
    say(f"tforce: document: {len(doc)} tokens{how} in {conv.prefill_s:.2f} s"
         + (f"; snapshot written to {save_kv}" if save_kv is not None else "")
         + ("" if as_json or not from_terminal else "; ask a question (Ctrl-C stops an answer, Ctrl-D ends)"))
    # the last whole answer as the conversation's history holds it (Conversation keeps end-of-sequence tokens
    # out of it, so the template's turn end follows the answer), which a question follows with --keep-history
    answer = None
    eos = set() if config.ignore_eos else eos_ids(model_config)
    separated = fmt.ends_with_separator(doc)  # a snapshot made before the document's piece ended with it: not
    stops = StopStrings(tok, setup.stops)
    for question in questions:
        ids = fmt.question_ids(question, answer if keep_history else None, separated)
        if len(ids) + 1 > conv.room_left:
            raise UsageError(f"the conversation has outgrown its room ({room} tokens after the document): "
                             "pass a larger --room" + (" or drop --keep-history" if keep_history else ""))
        try:
            tokens = _answer(conv, question, ids, tok, max_new, method, as_json, from_terminal, stops)
            answer = answer if tokens is None else [t for t in tokens if t not in eos]
        except KeyboardInterrupt:  # a second Ctrl-C while the first was reported, or one after the answer
            if not from_terminal:
                raise


def _conversation(setup, path, config, tok, doc: list[int], ranks: ExitStack, room: int, **kwargs):
    """A Conversation of setup.config in this process, or over setup.world ranks (entered on `ranks`, which
    ends them); config: the target's model configuration; kwargs: Conversation's."""
    from ..engine.conversation import Conversation
    from ..parallel.conversation import ParallelConversation
    from ..model.registry import resolve

    draft_config = read_draft_config(setup.draft, config, tok) if setup.draft else None
    if setup.world > 1:  # the ranks load their parts of the models
        draft = str(resolve(setup.draft)) if setup.draft else None
        return ranks.enter_context(ParallelConversation(path, draft, doc, setup.world, setup.device, setup.dtype,
                                                        setup.config, room=room, **kwargs))
    check_memory(config, draft_config, len(doc) + room, dtype_bytes(setup.dtype, setup.device), setup.device,
                  setup.config)
    target, small = setup.load()
    return Conversation(target, doc, setup.config, draft=small, room=room, **kwargs)


def _answer(conv, question: str, ids: list[int], tok, max_new: int, method: str, as_json: bool,
            from_terminal: bool, stops) -> Optional[list[int]]:
    """Stream one answer, ended at a --stop string (stops: stops.StopStrings); its tokens. Ctrl-C while it
    is written (questions from a terminal): it stops there, the text so far stays, its line is ended and one
    stderr line says so, and None (Conversation.ask leaves the stopped question out of the conversation)."""
    stream = TextStream(tok, sys.stdout, enabled=not as_json, stops=stops or None)
    progress = text_progress(stream, len(ids), max_new, method, as_json)
    try:
        events = Events(on_tokens=lambda r, tokens, acceptance: stream.add(tokens),
                        on_round=progress.on_round if progress else None,
                        on_prefill=progress.on_prefill if progress else None,
                        until=stops.cut if stops else None, on_step=threads.tick)
        result = conv.ask(ids, max_new, events)
        out = stream.finish()
    except BaseException as e:
        if progress:
            progress.close()
        if not (from_terminal and isinstance(e, KeyboardInterrupt)):
            end_line(stream.printed)
            raise
        _stopped(question, stream, as_json, conv.keep_history)
        return None
    if progress:
        progress.close()
    s = result.stats
    if as_json:
        record = {"question": question, "answer": out, "tokens": result.tokens, "stats": s, "interrupted": False,
                  "stopped_by": stops.matched(result.tokens)}
        sys.stdout.write(json.dumps(record) + "\n")
    elif not out.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if not as_json:
        say(_turn_line(len(result.tokens), s))
    return result.tokens


def _stopped(question: str, stream: TextStream, as_json: bool, keep_history: bool) -> None:
    if as_json:
        record = {"question": question, "answer": stream.text(), "tokens": stream.ids, "stats": None,
                  "interrupted": True, "stopped_by": None}
        sys.stdout.write(json.dumps(record) + "\n")
    elif stream.printed and not stream.printed.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    say(f"tforce: interrupted: the answer stopped after {len(stream.ids)} tokens"
         + ("; the question and its partial answer are left out of the history" if keep_history else ""))


def _turn_line(n: int, s: dict) -> str:
    acc = ", ".join(f"{k} {v:.1%}" for k, v in s["acceptance"].items() if v is not None)
    rate = f"{s['tokens_per_s']:.1f} tokens/s" if s["tokens_per_s"] else "n/a tokens/s"
    return (f"tforce: time to first token {s['ttft_s']:.2f} s (prefilled {s['prefilled_tokens']} of "
            f"{s['prompt_tokens']} prompt tokens); {n} tokens, {rate}" + (f"; acceptance: {acc}" if acc else ""))
