"""The embedded demo prompt, used when `tforce run`, `chat` or `bench` gets no prompt: the opening of Great
Expectations, chapter 1 and the start of chapter 2 (public domain; a book held out from the demo pair's
training), about 3,400 tokens of the demo tokenizer, within the demo target's 4,096-token context, and
about 3,000 of SmolLM2's; and a question about it. The model used when none is given: defaults.py.
"""
from __future__ import annotations

from ..paths import DATA

EXCERPT = DATA / "demo_excerpt.txt"
QUESTION = "Question: what did the narrator call himself?"
NAME = "the demo's excerpt (Great Expectations, chapters 1-2)"  # as the notices name it
BENCH_TOKENS = 3300  # of the excerpt, bench's default prompt on the demo pair (as `make demo`): beside --gen-len
# 256 it fits the demo target's 4,096-token context


def demo_prompt() -> str:
    return EXCERPT.read_text(encoding="utf-8").strip() + "\n\n" + QUESTION
