"""What a new user gets wrong, found by walking through the README: each mistake is one stderr line and a
non-zero exit, nothing the user gave is destroyed, and the README's notices hold in every mode."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tforce.cli import app
from tforce.synthetic import make_checkpoint

TARGET = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=512)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    make_checkpoint(root / "tiny-target", seed=0, **TARGET)
    make_checkpoint(root / "tiny-draft", seed=1, **DRAFT)
    gpt2 = root / "gpt2"  # a Hugging Face folder of another architecture
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}))
    (root / "doc.txt").write_text("It was the best of times, it was the worst of times.")
    return root


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def _one_error_line(result, code: int, needle: str = "") -> None:
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.output and "TFORCE_DEBUG" not in result.output
    assert result.stdout == ""


@pytest.mark.parametrize("args,role", [
    (["run", "-p", "hi", "--method", "ar", "-m", "{gpt2}"], "target model"),
    (["run", "-p", "hi", "-m", "{target}", "--draft", "{gpt2}"], "draft model"),
    (["chat", "{doc}", "-q", "{doc}", "--method", "ar", "-m", "{gpt2}"], "target model"),
    (["info", "-m", "{gpt2}"], ""),
])
def test_unsupported_architecture_is_a_usage_error(runner, models, args, role):
    """A config of another architecture is refused by its model type before anything reads its fields (it
    was an AttributeError from the memory plan, exit 1)."""
    paths = {"gpt2": models / "gpt2", "target": models / "tiny-target", "doc": models / "doc.txt"}
    r = runner.invoke(app, [a.format(**paths) for a in args])
    _one_error_line(r, 2, f"{role}: {paths['gpt2']}: model type 'gpt2' is not a Llama-family model".lstrip(": "))

