"""The embedded default: the trained demo pair and a book excerpt, used when `tforce run`, `chat` or `bench`
gets no model.

The pair lives in the repository's models/ (written by scripts/train_demo.py; see models/README.md);
TFORCE_DEMO_MODELS names another folder holding demo-target/ and demo-draft/. The excerpt is the opening
of Great Expectations, chapter 1 and the start of chapter 2 (public domain; a book held out from the demo
pair's training): about 3,400 tokens of the demo tokenizer, within the demo target's 4,096-token context.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import UsageError

EXCERPT = Path(__file__).resolve().parent / "data" / "demo_excerpt.txt"
QUESTION = "Question: what did the narrator call himself?"
NAME = "the demo's excerpt (Great Expectations, chapters 1-2)"  # as the notices name it
BENCH_TOKENS = 3300  # of the excerpt, bench's default prompt on the demo pair (as `make demo`): beside --gen-len
# 256 it fits the demo target's 4,096-token context


REPO_MODELS = Path(__file__).resolve().parent.parent / "models"  # the models committed with tforce


def models_dir() -> Path:
    env = os.environ.get("TFORCE_DEMO_MODELS")
    return Path(env).expanduser() if env else REPO_MODELS


def demo_pair() -> tuple[str, str]:
    """(target folder, draft folder) of the demo pair, or a UsageError saying how to get one."""
    root = models_dir()
    target, draft = root / "demo-target", root / "demo-draft"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise UsageError(f"no --model given and the demo pair is not in {root} "
                         "(python scripts/train_demo.py writes it): pass --model")
    return str(target), str(draft)


def notice(target: str, draft: str) -> str:
    """The stderr line that says the demo target is in use (draft: the one given, else the demo's)."""
    if Path(draft).resolve() != (models_dir() / "demo-draft").resolve():  # --draft: not the demo's own
        return (f"tforce: no --model given: using the trained demo target {target} (a small model trained by "
                f"scripts/train_demo.py, see models/README.md) with the draft {draft}")
    return (f"tforce: no --model given: using the trained demo pair {target} (draft: {draft}; "
            "small models trained by scripts/train_demo.py, see models/README.md)")


def demo_prompt() -> str:
    return EXCERPT.read_text(encoding="utf-8").strip() + "\n\n" + QUESTION
