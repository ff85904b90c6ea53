"""Response objects in OpenAI's shapes: completions and chat completions, whole or as server-sent-event
chunks. What tforce adds (acceptance per level, tokens per verification, the prefix reused) rides under
the key "tforce", which OpenAI's clients keep as an extra field."""
from __future__ import annotations

import json
import time
import uuid
from typing import Optional
from dataclasses import dataclass


@dataclass
class Done:
    """How a generation ended: finish_reason "stop" (end of sequence or a stop string) or "length"
    (max_tokens or the context), its token counts and tforce's statistics."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict
    logprobs: Optional[dict] = None  # the choice's "logprobs" object (token_logprobs), when asked for

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class Shape:
    """One response's identity (id, creation time, model) and its objects, for chat or completions."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, results: list) -> dict:
        """The response to (text, Done) per prompt: a choice each, indexed in order, usage summed. tforce's
        statistics: the one prompt's, or a list of each prompt's."""
        choices = []
        for i, (text, done) in enumerate(results):
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": done.logprobs, "finish_reason": done.finish_reason})
            else:
                choices.append({"index": i, "text": text, "logprobs": done.logprobs,
                                "finish_reason": done.finish_reason})
        stats = [done.stats for _, done in results]
        return self._object("chat.completion" if self.chat else "text_completion", choices,
                            usage=_summed([done for _, done in results]), tforce=stats[0] if len(stats) == 1 else stats)

    def chunk(self, text: str, first: bool = False, logprobs: Optional[dict] = None, index: int = 0) -> str:
        """An event carrying new text of choice `index` (chat: its first also names the assistant's role), and
        the log-probabilities of the tokens it carries when asked for."""
        return self._event(self._choice(index, text, None, first, logprobs))

    def last(self, done: Done, first: bool = False, logprobs: Optional[dict] = None, index: int = 0) -> str:
        """The event that ends choice `index`: its finish_reason and tforce's statistics (and the
        log-probabilities of tokens whose text no earlier event carried)."""
        return self._event(self._choice(index, "", done.finish_reason, first, logprobs), tforce=done.stats)

    def usage(self, dones: list) -> str:
        """stream_options.include_usage: one more event with no choices and the usage, summed over the choices."""
        return self._event(None, usage=_summed(dones))

    def _choice(self, index: int, text: str, finish_reason, first: bool, logprobs: Optional[dict]) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _event(self, choice, **extra) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return event(self._object(kind, [] if choice is None else [choice], **extra))


def _summed(dones: list) -> dict:
    usages = [done.usage() for done in dones]
    return {k: sum(u[k] for u in usages) for k in usages[0]}


def entries(picked: list, top: int) -> list:
    """(token, log-probability, [(id, log-probability)] x top) per (token id, raw log-probs (V,)) pair."""
    out = []
    for t, row in picked:
        alts = []
        if top:
            values, ids = row.topk(top)
            alts = list(zip(ids.tolist(), values.tolist()))
        out.append((int(t), float(row[t]), alts))
    return out


def token_logprobs(tok, entries: list, top: int, chat: bool, start: int = 0) -> dict:
    """The choice's "logprobs" for (token id, log-probability, [(id, log-probability)] alternatives) per
    token, with `top` alternatives each: chat's {"content": [{token, logprob, bytes, top_logprobs}]},
    completions' {tokens, token_logprobs, top_logprobs, text_offset}; an echoed prompt's first token has
    log-probability None (and, with top, top_logprobs None). A token's text is its own decoding (a piece of a
    multi-byte character decodes to U+FFFD; `bytes` has its UTF-8 bytes as decoded); text_offset is `start`
    plus the length of the tokens' texts before it."""
    def text(i: int) -> str:
        return tok.decode([i])

    if chat:
        def item(i, lp):
            return {"token": text(i), "logprob": lp, "bytes": list(text(i).encode("utf-8"))}
        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in alts]} for t, lp, alts in entries]}
    offsets, at = [], start
    for t, _, _ in entries:
        offsets.append(at)
        at += len(text(t))

    def by_text(lp, alts: list) -> Optional[dict]:  # completions' alternatives are keyed by text: two ids may share one
        if lp is None:
            return None
        out: dict = {}
        for i, v in alts:  # most likely first: a shared text keeps its likelier id's value
            out.setdefault(text(i), v)
        return out

    return {"tokens": [text(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [by_text(lp, alts) for _, lp, alts in entries] if top else None, "text_offset": offsets}


class LogprobParts:
    """A streamed choice's log-probabilities, a part per batch of tokens: each part's text_offset goes on from
    the last's, so that the parts joined are the whole answer's."""

    def __init__(self, tok, top: int, chat: bool):
        self.tok, self.top, self.chat, self.at = tok, top, chat, 0

    def part(self, entries: list) -> dict:
        out = token_logprobs(self.tok, entries, self.top, self.chat, self.at)
        if not self.chat:
            self.at += sum(len(t) for t in out["tokens"])
        return out


def joined(parts: list) -> Optional[dict]:
    """Parts of one choice's "logprobs" (LogprobParts) as one, None for none: each list concatenated (a
    completion's top_logprobs stays None without alternatives)."""
    if not parts:
        return None
    return {key: None if value is None else [x for p in parts for x in p[key]] for key, value in parts[0].items()}


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"
