"""What the new user's mistakes tests share (tests/cli/test_cli_user_errors.py, tests/cli/test_cli_snapshot_early.py):
the tiny pair with a folder of another architecture and a document (the `models` fixture), a short run of
the pair, and the check that a failure is one stderr line with no hint of a traceback."""
from __future__ import annotations

import json

import pytest

from tforce.cli import app
from tforce.model.synthetic import make_checkpoint

from cli_helpers import DRAFT, TARGET


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


def one_error_line(result, code: int, needle: str = "") -> None:
    """cli_helpers.one_error_line's check, and no TFORCE_DEBUG hint either."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.output and "TFORCE_DEBUG" not in result.output
    assert result.stdout == ""


def run_hi(runner, models, *args):
    """`tforce run` of the tiny pair on the prompt "hi", 2 greedy tokens by triforce, with args."""
    return runner.invoke(app, ["run", "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"),
                               "-p", "hi", "-n", "2", "-t", "0", "--method", "triforce", *args])
