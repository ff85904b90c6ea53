"""tforce.text.needle: the needle lands at the requested depth, the prompt has the requested length, the
answer is recoverable and the key appears exactly once."""
import importlib.util
import random
import sys
from pathlib import Path

import pytest

from tforce.text.needle import NEEDLE, needle_prompt
from tforce.model.synthetic import byte_tokenizer

WORDS = "the old house stood by a river and in the evening she would walk along its grey bank".split()
_rng = random.Random(0)
FILLER = " ".join(_rng.choice(WORDS) for _ in range(6000)) + "."
CHUNK = 8


def _bpe():
    spec = importlib.util.spec_from_file_location(
        "train_demo", Path(__file__).resolve().parents[2] / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = mod
    spec.loader.exec_module(mod)
    return mod.train_tokenizer([FILLER, "The pass key is 12345. Remember it. What is the pass key?"], 300, 10 ** 6)


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def tok(request):
    return byte_tokenizer() if request.param == "bytes" else _bpe()


def _find(seq, sub):
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub]


@pytest.mark.parametrize("context", [200, 777, 1500])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_depth_length_and_answer(tok, context, depth):
    key = "48213"
    prompt, answer = needle_prompt(tok, FILLER, context, depth, key, seed=3)
    assert len(prompt) == context
    assert prompt[0] == tok.bos_token_id
    needle = list(tok.encode(NEEDLE.format(key=key), add_special_tokens=False))
    at = _find(prompt, needle)
    assert len(at) == 1
    question = tok.encode("\nWhat is the pass key? The pass key is ", add_special_tokens=False)
    haystack = context - 1 - len(needle) - len(question)
    assert abs(at[0] - 1 - depth * haystack) <= CHUNK
    assert key in tok.decode(answer)
    text = tok.decode(prompt, skip_special_tokens=True)
    assert text.count(key) == 1
    assert text.rstrip().endswith("What is the pass key? The pass key is")


def test_seed_moves_the_window_and_errors(tok):
    a, _ = needle_prompt(tok, FILLER, 300, 0.5, "111", seed=1)
    assert any(needle_prompt(tok, FILLER, 300, 0.5, "111", seed=s)[0] != a for s in range(2, 6))
    assert needle_prompt(tok, FILLER, 300, 0.5, "111", seed=1)[0] == a
    with pytest.raises(ValueError):
        needle_prompt(tok, "too short", 300, 0.5, "111")
    with pytest.raises(ValueError):
        needle_prompt(tok, FILLER, 300, 1.5, "111")
