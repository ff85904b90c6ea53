"""Response objects in OpenAI's shapes: completions and chat completions, whole or as server-sent-event
chunks. What tforce adds (acceptance per level, tokens per verification, the prefix reused) rides under
the key "tforce", which OpenAI's clients keep as an extra field."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass


@dataclass
class Done:
    """How a generation ended: finish_reason "stop" (end of sequence or a stop string) or "length"
    (max_tokens or the context), its token counts and tforce's statistics."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict

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

    def whole(self, text: str, done: Done) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": done.finish_reason}
            return self._object("chat.completion", [choice], usage=done.usage(), tforce=done.stats)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
        return self._object("text_completion", [choice], usage=done.usage(), tforce=done.stats)

    def chunk(self, text: str, first: bool = False) -> str:
        """An event carrying new text (chat: the first also names the assistant's role)."""
        return self._event(self._choice(text, None, first))

    def last(self, done: Done, first: bool = False) -> str:
        """The event that ends the choice: its finish_reason and tforce's statistics."""
        return self._event(self._choice("", done.finish_reason, first), tforce=done.stats)

    def usage(self, done: Done) -> str:
        """stream_options.include_usage: one more event with no choices and the usage."""
        return self._event(None, usage=done.usage())

    def _choice(self, text: str, finish_reason, first: bool) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _event(self, choice, **extra) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return event(self._object(kind, [] if choice is None else [choice], **extra))


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"
