"""/tokenize, /detokenize and /tokenizer_info: the served model's tokenizer, in vLLM's shapes, also taking
llama-server's field names (`content`, `add_special`), so that clients that count or build token ids
(lm-evaluation-harness's local-completions) work against tforce serve."""
from __future__ import annotations

from .requests import ApiError, json_object, parse_messages


def tokenize(worker, raw: bytes) -> dict:
    """{prompt | content: text, add_special_tokens | add_special: bool} or {messages: [...]} (or prompt as
    such a list; laid out in the chat template, as /v1/chat/completions does) -> {tokens, count, max_model_len}."""
    body = json_object(raw)
    text = body.get("prompt", body.get("content"))
    if "messages" in body or _messages(text):
        # lm-evaluation-harness's remote tokenizer with --apply_chat_template sends the messages as prompt
        ids = worker.chat_ids(parse_messages(body.get("messages", text)))
    else:
        if not isinstance(text, str):
            raise ApiError(400, "tokenize takes prompt (or content) as a string, or messages", param="prompt")
        special = body.get("add_special_tokens", body.get("add_special", True))
        if not isinstance(special, bool):
            raise ApiError(400, "add_special_tokens must be true or false", param="add_special_tokens")
        ids = worker.text_ids(text, special)
    return {"tokens": ids, "count": len(ids), "max_model_len": worker.context}


def _messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def detokenize(worker, raw: bytes) -> dict:
    """{tokens: [ids]} -> {prompt: text} (vLLM's key) and {content: text} (llama-server's)."""
    ids = json_object(raw).get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ApiError(400, "detokenize takes tokens as a list of token ids", param="tokens")
    text = worker.text_of(ids)
    return {"prompt": text, "content": text}


def tokenizer_info(worker) -> dict:
    tok = worker.tok
    return {"tokenizer_class": type(tok).__name__, "model_max_length": worker.context,
            "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
            "chat_template": getattr(tok, "chat_template", None), "vocab_size": len(tok)}
