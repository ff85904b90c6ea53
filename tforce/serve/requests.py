"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) checked into an `Ask`, and the one
error type every refusal takes, rendered in OpenAI's shape `{"error": {"message", "type", "code", "param"}}`.

What tforce cannot honour is refused with a 400 naming the parameter (n > 1, chat's echo, tools,
penalties, min_p), never silently ignored; those set to their no-op values (`logit_bias: {}`,
`response_format: {"type": "text"}`, `tool_choice: "none"`, `presence_penalty: 0`...) and parameters that
do not change the tokens (user, metadata) are accepted. top_k is applied, as every level of the hierarchy
applies the same sampling transform (config.Sampling).
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
# anything but one of their no-op values (None, absent, or these, as clients send them by default).
_NO_OP = {"n": (1,), "best_of": (1,), "suffix": ("",),
          "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
          "logit_bias": ({},), "response_format": ({"type": "text"},), "presence_penalty": (0,),
          "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,)}


@dataclass(frozen=True)
class Ask:
    """One request, checked. prompt (completions) or messages (chat); None fields take the server's
    defaults (its --max-new-tokens, --temperature, --top-p)."""

    chat: bool
    model: Optional[str]
    prompts: tuple = ()  # completions: each prompt, as text (str) or as token ids (a tuple)
    messages: Optional[tuple] = None  # ({"role", "content"} with content as text, ...)
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # 0: off
    stop: tuple = ()
    seed: Optional[int] = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk carrying usage
    logprobs: Optional[int] = None  # report each generated token's log-probability and this many alternatives
    echo: bool = False  # completions: the prompt before the answer (and its tokens' log-probabilities)


def json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object; ApiError (400) else."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def parse(raw: bytes, chat: bool) -> Ask:
    """The request body of /v1/chat/completions (chat) or /v1/completions, checked; ApiError (400) else."""
    body = json_object(raw)
    for key, neutral in _NO_OP.items():
        value = body.get(key)
        if value is not None and not any(_same(value, v) for v in neutral):
            raise ApiError(400, f"{key}={json.dumps(value)[:40]} is not supported by tforce serve", param=key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    common = dict(model=model, max_tokens=_max_tokens(body, chat),
                  temperature=_number(body, "temperature", 0, 2), top_p=_number(body, "top_p", 0, 1, low_open=True),
                  top_k=_top_k(body),
                  stop=_stops(body.get("stop")), seed=_integer(body, "seed", -2**63, 2**64 - 1),
                  stream=_flag(body, "stream"), include_usage=_flag(stream_options, "include_usage"),
                  logprobs=_logprobs(body, chat))
    echo = _flag(body, "echo")
    if echo and chat:
        raise ApiError(400, "echo is not supported by /v1/chat/completions", param="echo")
    if chat:
        return Ask(chat=True, messages=parse_messages(body.get("messages")), **common)
    prompts = _prompts(body.get("prompt"))
    return Ask(chat=False, prompts=prompts, echo=echo, **common)


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's API


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """None (no log-probabilities), or how many alternatives each token lists: completions' `logprobs: N`;
    chat's `logprobs: true` with `top_logprobs: N` (default 0)."""
    if chat:
        on = _flag(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top and not on:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        n = (top or 0) if on else None
    else:
        if body.get("logprobs") is False:
            return None
        n = _integer(body, "logprobs", 0, MAX_LOGPROBS)
        if body.get("top_logprobs"):
            raise ApiError(400, "completions take logprobs: N (top_logprobs is chat's)", param="top_logprobs")
    return n


def _same(a, b) -> bool:
    """a == b as JSON means it: 0 and 0.0 alike, but not false and 0."""
    number = (int, float)
    if isinstance(a, number) and isinstance(b, number) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    return type(a) is type(b) and a == b


def _top_k(body: dict) -> Optional[int]:
    """top_k as vLLM and llama-server take it: -1 (and 0) mean off."""
    if body.get("top_k") == -1 and not isinstance(body.get("top_k"), bool):
        return 0
    return _integer(body, "top_k", 0, None)


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
    if "" in stops:
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return tuple(stops)


def _prompts(value) -> tuple:
    """Each prompt: its text, or a tuple of token ids. One prompt is a string or a list of integers (as
    lm-evaluation-harness sends one); several are a list of strings or a list of lists of integers."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(value))
    return (_prompt(value, "the prompt"),)


def _prompt(value, what: str) -> "str | tuple":
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return tuple(value)
    if isinstance(value, list):
        raise ApiError(400, f"{what} must be a string or a list of token ids (integers); prompt may also be a "
                            "list of those", param="prompt")
    if not isinstance(value, str):
        raise ApiError(400, f"{what} must be a string or a list of token ids", param="prompt")
    if not value:
        raise ApiError(400, f"{what} is empty", param="prompt")
    return value


def parse_messages(value) -> tuple:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role and a content", param="messages")
        # an assistant turn that called tools has content null
        out.append({"role": m["role"], "content": "" if m.get("content") is None else _content(m["content"], i)})
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
