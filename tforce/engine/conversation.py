"""A document prefilled once, then questions about it, each answered without prefilling the document again.

Each question's prompt is the document followed by the question's tokens (with keep_history, by the
earlier questions and answers too). The session's nodes keep what they hold of it (session.Session.prefill):
the full cache rolls back to the document's end and takes only the question, the retrieval cache is
selected again for the question's last token, and the streaming caches restore their states marked at the
document's end. Every answer is therefore exactly the answer generate() gives for the same prompt ids: the
target's greedy tokens, or an exact sample (with a seed, drawn as generate would draw it).

An ask() that stops part-way (an exception from a callback, Ctrl-C at any point) leaves no trace: its
question and partial answer do not join the history, and the next ask() first rewinds the session to the
history's end (session.Session.rewind), so that it answers exactly as if the stopped one had never been
asked. With keep_history the streaming caches' states are therefore marked at the history's end before
each question (a copy of the draft's window; with method "streaming", of the target's window too).
"""
from __future__ import annotations

import time

import torch

from ..snapshot import format as snapshot, identity as snapshot_identity, store as snapshot_io
from ..config import RunConfig
from .driver import drive
from .events import Events
from .statistics import one_row
from .generate import Result, eos_ids, networks, check_ids, check_prompt, configured, generator, open_session
from ..errors import UsageError
from .session import Session, sync_device


class Conversation:
    def __init__(self, target, document_ids=None, config: RunConfig | None = None, *, draft=None,
                 room: int | None = None, keep_history: bool = False, group=None, on_prefill=None, **options):
        """document_ids: the prefix every question follows (None with config.load_kv: the snapshot's prefix).
        room: tokens after the document for questions and answers (and, with keep_history, the whole
        conversation); default: the rest of the model's context. config and the flat options beside it:
        generate()'s (the method, sampling, budgets, execution; max_new_tokens is each answer's default;
        load_kv / save_kv: KV snapshots of the document, snapshot/format.py). on_prefill(done, total): the
        document's prefill progress. group: the tensor-parallel ranks (parallel.Group) when target is one
        rank's shard (parallel/conversation.py)."""
        config = configured(config, options)
        load_kv, save_kv = config.load_kv, config.save_kv
        ident = snapshot_identity.identity(target, draft, group) if load_kv is not None or save_kv is not None else None
        self.target, self.draft = networks(target, draft)
        if document_ids is None:
            if load_kv is None:
                raise UsageError("no document: give one, or a snapshot to load (--load-kv)")
            document_ids = snapshot.read_manifest(load_kv)["tokens"]
        doc = torch.as_tensor(list(document_ids), dtype=torch.long)
        context = self.target.config.max_position_embeddings
        room = context - len(doc) if room is None else min(room, context - len(doc))
        check_prompt(self.target, len(doc), 0)
        check_ids(self.target, doc, "the document")
        if room < 2:
            raise UsageError(f"the document is {len(doc)} tokens; the model's context ({context}) leaves no room "
                             f"for a question")
        if save_kv is not None:
            snapshot.check_target(save_kv)
        self.seed, self.keep_history = config.sampling.seed, keep_history
        self.max_new_tokens = config.max_new_tokens
        self.eos = set() if config.ignore_eos else eos_ids(self.target.config)
        self.session: Session = open_session(self.target, self.draft, len(doc), room, config, group)
        self.document = doc.tolist()
        self.history = list(self.document)
        self.marked = len(doc)  # the streaming caches' states are marked at history[:marked]
        self.unfinished = False  # an ask() stopped part-way: the session must rewind to the history first
        device = next(self.target.parameters()).device
        t0 = time.perf_counter()
        self.kv_reused = 0
        if load_kv is not None:
            self.kv_reused = snapshot_io.load(load_kv, self.session, doc, len(doc), ident, group)[0]
        self.session.prefill([doc], on_prefill, upto=[len(doc)])
        self.session.mark()
        sync_device(device)
        self.prefill_s = time.perf_counter() - t0
        if save_kv is not None:
            snapshot_io.save(save_kv, self.session, ident, group)

    @property
    def room_left(self) -> int:
        """Tokens the next question and its answer may still take."""
        return self.session.total - len(self.history)

    def ask(self, question_ids, max_new_tokens: int | None = None, events: Events | None = None,
            seed: int | None = None) -> Result:
        """Answer after the document (and, with keep_history, the conversation so far) in at most
        max_new_tokens (default: the configuration's), sampling with `seed` (default: the conversation's;
        every answer is drawn from it alone), telling `events` as generate does (on_prefill: the question's
        prefill); stats add ttft_s (from the call to the first token), prompt_tokens and prefilled_tokens
        (what was fed beyond the caches' reuse)."""
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        prompt = self.history + list(question_ids)
        if len(question_ids) == 0:
            raise UsageError("the question is empty")
        check_ids(self.target, list(question_ids), "the question")
        if len(prompt) >= self.session.total:
            raise UsageError(f"the conversation ({len(prompt)} tokens) has outgrown its room "
                             f"({self.session.total} tokens with the document)")
        max_new = min(check_prompt(self.target, len(prompt), max_new_tokens), self.session.total - len(prompt))
        session = self.session
        if self.unfinished:
            session.rewind(len(self.history))
            self.unfinished = False
        if self.marked != len(self.history):
            session.mark(torch.tensor(self.history))
            self.marked = len(self.history)
        self.unfinished = True
        session.reset_stats()
        gen = generator(self.target, self.seed if seed is None else seed)
        [out], [stats] = drive(session, [prompt], [max_new], gen, self.eos, events or Events())
        history = prompt + [t for t in out if t not in self.eos] if self.keep_history else self.history
        self.history, self.unfinished = history, False
        return Result(out, one_row(stats))
