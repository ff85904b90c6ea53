"""A Conversation's ask() stopped part-way (KeyboardInterrupt from a callback, or from inside the engine right
after a cache commits, before its node records the tokens) leaves no trace: the next answer is the one a
conversation that never asked the stopped question gives, greedy token for token and sampled draw for draw
(same seed); with keep_history the stopped question and its partial answer stay out of the history."""
from __future__ import annotations

import pytest

from tforce.engine.conversation import Conversation
from tforce.engine.events import Events

from exactness_helpers import SMALL
from model_helpers import ids

DOC = ids(45)
Q1 = ids(9, seed=1)
QX = Q1[:3] + ids(6, seed=2)  # shares a prefix with Q1, as every chat question shares its separator
OPTS = dict(ignore_eos=True, rebuild_every=8, seed=7, room=200, **SMALL)
N = 24
# Where the stopped ask raises: a callback at its n-th call, or a node's cache right after its n-th commit
# (before the node records what it fed: prefill_chunk=4 splits the question's prefill into chunks).
WHERE = [("on_prefill", 1), ("on_tokens", 1), ("on_tokens", 3), ("on_round", 2), ("full", 1), ("full", 3),
         ("small", 2), ("middle", 4)]
NODES = {"ar": {"full"}, "retrieval": {"full", "middle"}, "triforce": {"full", "middle", "small"},
         "streaming": {"full", "middle", "small"}}


def cases():
    """(method, offload, temperature, where, calls): sampled draw for draw at every point for triforce and
    streaming (the most state to restore), at a few for the others; greedy where a half-recorded commit of
    the full cache would change the tokens themselves."""
    for method, offload in [("ar", "off"), ("triforce", "off"), ("retrieval", "off"), ("streaming", "off"),
                            ("triforce", "on")]:
        every = offload == "off" and method in ("triforce", "streaming")
        for where, calls in WHERE:
            if where in NODES[method] | {"on_prefill", "on_tokens", "on_round"} and (
                    every or (where, calls) in [("on_prefill", 1), ("on_tokens", 3), ("full", 1), ("middle", 4)]):
                yield method, offload, 0.9, where, calls
        yield method, offload, 0, "full", 1


_expected: dict = {}


def conversation(tiny, method, offload, temperature, keep_history):
    return Conversation(tiny["gqa"], DOC, draft=tiny["draft"], method=method, offload=offload,
                        temperature=temperature, keep_history=keep_history, prefill_chunk=4, **OPTS)


def expected(tiny, *key) -> list[int]:
    """The answer to Q1 asked after Q1 was answered (with keep_history: following it; else: as a fresh
    conversation's first answer)."""
    if key not in _expected:
        ref = conversation(tiny, *key)
        first = ref.ask(Q1, N).tokens
        _expected[key] = ref.ask(Q1, N).tokens if key[-1] else first
    return _expected[key]


def stop_after(calls: int):
    """A callback (or wrapper) that raises KeyboardInterrupt at its `calls`-th call."""
    seen = []

    def callback(*args):
        seen.append(args)
        if len(seen) == calls:
            raise KeyboardInterrupt

    return callback


def ask_stopped(conv: Conversation, where: str, calls: int) -> None:
    if where.startswith("on_"):
        with pytest.raises(KeyboardInterrupt):
            conv.ask(QX, N, Events(**{where: stop_after(calls)}))
        return
    cache, stop = getattr(conv.session, where).cache, stop_after(calls)

    def commit(n):  # the interrupt lands after the commit, before the node records the tokens it fed
        type(cache).commit(cache, n)
        stop()

    cache.commit = commit
    try:
        with pytest.raises(KeyboardInterrupt):
            conv.ask(QX, N)
    finally:
        del cache.commit


@pytest.mark.parametrize("keep_history", [False, True])
@pytest.mark.parametrize("method,offload,temperature,where,calls", list(cases()))
def test_a_stopped_answer_leaves_no_trace(tiny, method, offload, temperature, keep_history, where, calls):
    conv = conversation(tiny, method, offload, temperature, keep_history)
    conv.ask(Q1, N)
    history = list(conv.history)
    ask_stopped(conv, where, calls)
    assert conv.history == history  # the stopped question and its partial answer are left out
    assert conv.ask(Q1, N).tokens == expected(tiny, method, offload, temperature, keep_history)


def test_a_rolled_back_full_cache_drops_its_chunk_statistics(tiny):
    """Without a stop: a question after another (no history) is sampled draw for draw as a fresh
    conversation samples it. The retrieval cache's chunk statistics of the earlier question's rows must go
    when the full cache rolls back under them (they cover positions the next question writes again)."""
    for method in ("retrieval", "triforce"):
        conv = conversation(tiny, method, "off", 0.9, False)
        conv.ask(ids(12, seed=5), N)
        assert conv.ask(Q1, N).tokens == expected(tiny, method, "off", 0.9, False), method
