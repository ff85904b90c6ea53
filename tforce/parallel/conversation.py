"""A Conversation with the target split over tensor-parallel ranks (`tforce chat --tp N`).

Each rank is a persistent worker (ranks.Ranks, serving): it loads its shard of the target (and the
replicated draft), builds a Conversation once, so that the document is prefilled once over the ranks, and
then answers every question the parent sends it until told to stop. The ranks' memory plans are compared
before the document's prefill (session.Session, parallel.Group.check_plan). Rank 0's events (on_token, on_prefill,
on_round) come back to the parent as they happen, so answers stream as with one process. After every
answer all ranks compare their tokens (as generate_tp does at the end of a run) and fail together if
they differ; any failure ends every rank and the conversation with it.

Ctrl-C while an answer is produced stops it as in one process (Conversation: the stopped question leaves
no trace): the parent raises a stop flag that the ranks read together after every round (AnyRank, one
small all_reduce a round), so that all stop after the same round; ask() then raises KeyboardInterrupt and
the ranks wait for the next question. A second Ctrl-C before they have stopped ends them. Ctrl-C during
the document's prefill ends them too.
"""
from __future__ import annotations

import secrets

import torch.multiprocessing as mp

from ..engine.generate import Result
from ..errors import TforceError
from ..engine.events import Events
from ..engine.generate import configured
from .tp import AnyRank, Group, agreed_free, all_equal, rank_callbacks, rank_models, tp_options
from .ranks import Ranks

ASKED = ("on_prefill", "on_tokens", "on_round")  # the events a question's callers listen to, sent on by rank 0
STOPPED = "stopped"  # a rank's reply to a question whose answer Ctrl-C stopped


class ParallelConversation:
    """Conversation's interface (ask, room_left, keep_history, prefill_s, kv_reused) over `world` ranks;
    a context manager: leaving it (or close()) ends the ranks."""

    def __init__(self, model_path, draft_path, document_ids, world: int, device: str = "cpu", dtype=None,
                 config=None, *, room: int | None = None, keep_history: bool = False, on_prefill=None, **options):
        """As Conversation's arguments, with the models given as folders (each rank loads its part), the
        world size, and the device ("cpu": gloo; "cuda": NCCL, rank r on cuda:r); document_ids is always
        given (with load_kv, snapshot.read_manifest(load_kv)["tokens"] is the snapshot's document). Without
        a seed, each answer is sampled with one drawn here for it, the same on every rank."""
        config = configured(config, options)
        self.seed, self.keep_history = config.sampling.seed, keep_history
        self.max_new_tokens = config.max_new_tokens
        dtype, config, free = tp_options(device, dtype, config, world)
        self._callbacks = {"on_prefill": on_prefill}
        self._stop = mp.get_context("spawn").Event()
        self.ranks = Ranks(conversation_worker, world, "nccl" if device == "cuda" else "gloo", str(model_path),
                           str(draft_path) if draft_path else None, list(document_ids), device, dtype, config,
                           dict(room=room, keep_history=keep_history), free, on_prefill is not None, self._stop,
                           on_event=self._event, serve=True)
        self.kv_reused, self.prefill_s, self.room_left = self.ranks.collect()[0]

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        self.ranks.__exit__(kind, value, tb)

    def close(self) -> None:
        self.ranks.close()

    def _event(self, event) -> None:
        name, args = event
        if self._callbacks.get(name) is not None:
            self._callbacks[name](*args)

    def ask(self, question_ids, max_new_tokens: int | None = None, events=None, seed: int | None = None) -> Result:
        """Conversation.ask, answered by the ranks; rank 0's Result. KeyboardInterrupt: Ctrl-C stopped it."""
        events = events or Events()
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        until = events.until
        self._callbacks = {name: getattr(events, name) for name in ASKED}
        if seed is None:
            seed = self.seed if self.seed is not None else secrets.randbits(63)
        names = tuple(name for name, f in self._callbacks.items() if f is not None)
        self._stop.clear()
        try:
            self.ranks.send((list(question_ids), max_new_tokens, seed, names, until))
            reply, self.room_left = self.ranks.collect(on_interrupt=self._stop.set)[0]
        except KeyboardInterrupt:  # a second Ctrl-C, one just before collect() took it over, or a callback's
            self.ranks.close(wait_s=0.0)
            raise
        if reply == STOPPED:
            raise KeyboardInterrupt
        return reply  # Ctrl-C after the last round: the answer is whole


class _Stopped(Exception):
    """Raised on every rank after the same round when the parent asked them to stop."""


def conversation_worker(rank, world, model_path, draft_path, document_ids, device, dtype, config, shape, free,
                         prefill_events: bool, stop, emit=None):
    """One rank of ParallelConversation, a generator (ranks.Ranks' serving protocol): yields
    (kv_reused, prefill_s, room_left) once the document is prefilled, then (Result or STOPPED, room_left)
    for every (question_ids, max_new_tokens, seed, event names, until) it is sent, once all ranks agree on the
    answer. stop: the parent's Event asking to stop the answer."""
    from ..engine.conversation import Conversation

    target, small, dev = rank_models(model_path, draft_path, device, dtype, rank, world)
    device_free = agreed_free(dev, free[rank], config.execution.gpu_memory)
    config = config.with_options(device_free=device_free, gpu_memory=None)  # folded into device_free
    callbacks = rank_callbacks(rank, emit, ASKED)
    conv = Conversation(target, document_ids, config, draft=small, group=Group(),
                        on_prefill=callbacks.get("on_prefill") if prefill_events else None, **shape)
    any_rank = AnyRank()
    command = yield conv.kv_reused, conv.prefill_s, conv.room_left
    while True:
        ids, max_new, seed, names, until = command
        events = {name: callbacks[name] for name in names if name in callbacks}
        reported = events.pop("on_round", None)

        def on_round(tokens, counts, reported=reported):
            if reported is not None:
                reported(tokens, counts)
            if any_rank(stop.is_set()):
                raise _Stopped

        try:
            reply = conv.ask(ids, max_new, Events(on_round=on_round, until=until, **events), seed=seed)
        except _Stopped:
            reply = STOPPED
        if not all_equal(reply if reply == STOPPED else reply.tokens):
            raise TforceError("the tensor-parallel ranks answered with different tokens: please report this")
        command = yield reply, conv.room_left
