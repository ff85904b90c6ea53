"""What the command-line tests share: the tiny pair's shapes, a document and fast options, `tforce bench`'s
synthetic command line, the tiny models (the `models` fixture) and a CliRunner (`runner`), a run of the
pair, plain decoding's tokens to compare with, and the check that a failure is one stderr line."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.model.synthetic import make_checkpoint

TARGET = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=512)
DOC = "It was the best of times, it was the worst of times, it was the age of wisdom."
FAST = ["--budget", "64", "--draft-budget", "32", "--sinks", "4", "-n", "12", "--temperature", "0"]
BENCH = ["bench", "--synthetic", "tiny", "--device", "cpu", "--prompt-len", "200", "--gen-len", "16"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_checkpoint(root / "tiny-target", seed=0, **TARGET)
    make_checkpoint(root / "tiny-draft", seed=1, **DRAFT)
    make_checkpoint(root / "other-vocab", seed=2, vocab_size=300, tokenizer=False, **DRAFT)
    make_checkpoint(root / "no-tokenizer", seed=3, tokenizer=False, **TARGET)
    broken = root / "broken"
    broken.mkdir()
    for f in (root / "tiny-target").iterdir():  # config and tokenizer, so that the weights are what fails
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    (root / "doc.txt").write_text(DOC)
    return root


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def run_pair(runner, models, *args, input=None, env=None):
    """`tforce run` of the tiny pair (triforce unless args name another method)."""
    base = ["run", "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"), "--method", "triforce"]
    return runner.invoke(app, base + list(args), input=input, env=env)  # a later --method wins


def expected_tokens(models, text: str, n: int = 12) -> list[int]:
    """The tiny target's plain greedy decoding of text: what every method's greedy output must be."""
    target = tforce.load_model(str(models / "tiny-target"))
    ids = target.tokenizer.encode(text)
    return tforce.generate(target.model, ids, method="ar", max_new_tokens=n, temperature=0).tokens


def one_error_line(result, code: int, needle: str = "") -> None:
    """Exit `code`, one `tforce: error:` line on stderr holding needle, no traceback, nothing on stdout."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert result.stdout == ""


def session_configs(monkeypatch) -> list:
    """The RunConfig of every Session built from now on (Session(target, draft, prompt_len, max_new, config,
    ...)), appended as each is built: what the command line handed the engine."""
    import tforce.engine.generate as engine

    seen, real = [], engine.Session.__init__

    def spy(self, *args, **kwargs):
        seen.append(args[4])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(engine.Session, "__init__", spy)
    return seen
