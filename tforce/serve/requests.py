"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) checked into an `Ask`, and the one
error type every refusal takes, rendered in OpenAI's shape `{"error": {"message", "type", "code", "param"}}`.

What tforce cannot honour is refused with a 400 naming the parameter (n > 1, echo, logprobs, tools),
never silently ignored; parameters that do not change the tokens (user, metadata) are accepted.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional


class ApiError(Exception):
    """A refused request: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


# Parameters that would change what is returned in ways tforce does not implement: refused when set to
# anything but their no-op value.
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
                "tools": None, "functions": None, "tool_choice": None, "function_call": None, "logit_bias": None,
                "response_format": None}
MAX_STOPS = 4  # as OpenAI's API


@dataclass(frozen=True)
class Ask:
    """One request, checked. prompt (completions) or messages (chat); None fields take the server's
    defaults (its --max-new-tokens, --temperature, --top-p)."""

    chat: bool
    model: Optional[str]
    prompt: Optional[str] = None
    messages: Optional[tuple] = None  # ({"role", "content"} with content as text, ...)
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: tuple = ()
    seed: Optional[int] = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk carrying usage


def parse(raw: bytes, chat: bool) -> Ask:
    """The request body of /v1/chat/completions (chat) or /v1/completions, checked; ApiError (400) else."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, neutral in _UNSUPPORTED.items():
        value = body.get(key, neutral)
        if value is not None and value != neutral and not (key == "logprobs" and value is False):
            raise ApiError(400, f"{key}={json.dumps(value)[:40]} is not supported by tforce serve", param=key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    common = dict(model=model, max_tokens=_max_tokens(body, chat),
                  temperature=_number(body, "temperature", 0, 2), top_p=_number(body, "top_p", 0, 1, low_open=True),
                  stop=_stops(body.get("stop")), seed=_integer(body, "seed", -2**63, 2**64 - 1),
                  stream=_flag(body, "stream"), include_usage=_flag(stream_options, "include_usage"))
    if chat:
        return Ask(chat=True, messages=_messages(body.get("messages")), **common)
    return Ask(chat=False, prompt=_prompt(body.get("prompt")), **common)


def _max_tokens(body: dict, chat: bool) -> Optional[int]:
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    return _integer(body, key, 0, None)


def _integer(body: dict, key: str, lo: int, hi: Optional[int]) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer, got {json.dumps(value)[:40]}", param=key)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{key} must be {bound}, got {value}", param=key)
    return value


def _number(body: dict, key: str, lo: float, hi: float, low_open: bool = False) -> Optional[float]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ApiError(400, f"{key} must be a number, got {json.dumps(value)[:40]}", param=key)
    if value < lo or value > hi or (low_open and value == lo):
        raise ApiError(400, f"{key} must be in {'(' if low_open else '['}{lo}, {hi}], got {value}", param=key)
    return float(value)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be true or false, got {json.dumps(value)[:40]}", param=key)
    return value


def _stops(value) -> tuple:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    if "" in stops:
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return tuple(stops)


def _prompt(value) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # a batch of one prompt
    if isinstance(value, list):
        raise ApiError(400, "prompt must be one string (a list of prompts or of token ids is not supported)",
                       param="prompt")
    if not isinstance(value, str):
        raise ApiError(400, "prompt must be a string", param="prompt")
    if not value:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return value


def _messages(value) -> tuple:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role and a content", param="messages")
        out.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return tuple(out)


def _content(content, i: int) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be text (a string or a list of text parts)",
                   param="messages")
