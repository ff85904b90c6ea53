"""Passkey ("needle in a haystack") prompts: a key hidden at a chosen depth of a filler text.

    prompt_ids, answer_ids = needle_prompt(tok, book_text, context_tokens=1024, depth=0.3, key="48213", seed=0)

The prompt is [bos] + filler[:i] + NEEDLE + filler[i:] + QUESTION, exactly `context_tokens` ids long,
with i = round(depth * len(filler)): depth is the fraction of the haystack above the needle. The
pieces are tokenized separately and concatenated, so the needle and the answer tokenize the same way
wherever they land. scripts/train_demo.py trains the demo target on these prompts (followed by the
answer) and measures its passkey accuracy with them.
"""
from __future__ import annotations

import random

NEEDLE = " The pass key is {key}. Remember it. "
QUESTION = "\nWhat is the pass key? The pass key is "


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def random_key(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def needle_prompt(tokenizer, filler_text: str, context_tokens: int, depth: float, key: str,
                  seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt_ids, answer_ids): a `context_tokens`-id prompt hiding `key` at `depth` (0..1) of it.

    The filler is a window of `filler_text`'s tokens starting at an offset drawn from `seed`; the
    answer is the key's ids (greedy decoding after the prompt should produce exactly them).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], not {depth}")
    needle, question = _ids(tokenizer, NEEDLE.format(key=key)), _ids(tokenizer, QUESTION)
    answer = _ids(tokenizer, str(key))
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    n_fill = context_tokens - len(bos) - len(needle) - len(question)
    if n_fill < 0:
        raise ValueError(f"context_tokens={context_tokens} cannot hold the needle and the question")
    filler = _ids(tokenizer, filler_text)
    if len(filler) < n_fill:
        raise ValueError(f"the filler text has {len(filler)} tokens; {n_fill} are needed")
    start = random.Random(seed).randint(0, len(filler) - n_fill)
    filler = filler[start:start + n_fill]
    at = round(depth * n_fill)  # the needle's first id lands at index len(bos) + at
    prompt = bos + filler[:at] + needle + filler[at:] + question
    assert len(prompt) == context_tokens
    return prompt, answer
