"""The registry of short names: a default draft for every model (so the default method runs on a
user's first command), and every name documented where users look for it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tforce.cli.setup import default_draft
from tforce.model.registry import LOOKUP, REGISTRY

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_hub_model_has_a_default_draft(name):
    repo, draft = REGISTRY[name]
    if repo.startswith("pip:"):  # a packaged GGUF (smollm2): n-gram lookup or a committed draft (test_smollm2_draft.py)
        assert (draft == LOOKUP or draft.startswith("models:")) and default_draft(name) == draft
        return
    assert repo.count("/") == 1 and draft is not None and draft.count("/") == 1
    assert default_draft(name) == draft
    assert draft.split("/")[0] == repo.split("/")[0] or draft == "JackFram/llama-68m"  # same publisher's tokenizer


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_short_name_is_documented(name):
    for doc in ("README.md", "docs/models.md"):
        assert f"`{name}`" in (ROOT / doc).read_text(), (doc, name)
