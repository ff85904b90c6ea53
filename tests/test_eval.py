"""`tforce eval` end to end on tiny random models: every output file is written, in a few seconds."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from tforce.cli import app
from tforce.synthetic import make_checkpoint


def test_eval_writes_results_and_plots(tmp_path):
    target = make_checkpoint(tmp_path / "t-target", seed=0, num_key_value_heads=2, max_position_embeddings=512)
    make_checkpoint(tmp_path / "t-draft", seed=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, num_hidden_layers=1, max_position_embeddings=512)
    books = tmp_path / "books"
    books.mkdir()
    for i in range(2):
        (books / f"b{i}.txt").write_text(" ".join(f"word{j * (i + 3)}" for j in range(800)))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "eval", "-m", str(target), "--books", str(books / "*.txt"), "--context", "120,160",
        "--budgets", "16,32", "--budget", "32", "--chunk-sizes", "4,8", "--gamma1s", "1,2", "--gamma2s", "2,4",
        "--temperatures", "0,1", "--gen-len", "4", "--sweep-prompts", "1", "--threads", "1", "--out", str(out),
        "--json"])
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout)
    assert res["draft"].endswith("t-draft")  # the sibling X-draft of X-target
    for name in ("results.json", "results.md", "table1_policies.png", "budget.png", "chunk_size.png",
                 "gamma1.png", "gamma2.png", "temperature.png", "speed.png"):
        assert (out / name).stat().st_size > 0, name
    t1 = res["table1"]
    assert len(t1) == 2 * 2 * 4  # tasks x contexts x policies
    assert all(0 <= r["acceptance"] <= 1 for r in t1)
    assert {r["method"] for r in res["speed"]} == {"ar", "triforce"}
    assert "Table 1" in (out / "results.md").read_text()
