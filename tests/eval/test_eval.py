"""`tforce eval` end to end on tiny random models: every output file is written, in a few seconds."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tforce.cli import app
from tforce.model.synthetic import make_checkpoint


def _tiny_pair(tmp_path):
    target = make_checkpoint(tmp_path / "t-target", seed=0, num_key_value_heads=2, max_position_embeddings=512)
    make_checkpoint(tmp_path / "t-draft", seed=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, num_hidden_layers=1, max_position_embeddings=512)
    books = tmp_path / "books"
    books.mkdir()
    for i in range(2):
        (books / f"b{i}.txt").write_text(" ".join(f"word{j * (i + 3)}" for j in range(800)))
    return target, books


def test_eval_writes_results_and_plots(tmp_path):
    target, books = _tiny_pair(tmp_path)
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
    assert len(t1) == 2 * 2 * 5  # tasks x contexts x policies
    assert all(0 <= r["acceptance"] <= 1 for r in t1)
    assert {r["method"] for r in res["speed"]} == {"ar", "triforce"}
    assert "Table 1" in (out / "results.md").read_text()
    # needle runs report how often the output starts with the key; pg19 runs have no key
    assert all((r["answer_rate"] is None) == (r["task"] == "pg19") for r in t1)
    assert all(0 <= r["answer_rate"] <= 1 for r in t1 if r["task"] == "needle")
    assert "key in output" in (out / "results.md").read_text()


def test_eval_refuses_contexts_that_leave_no_room_to_generate(tmp_path):
    """A pg19 point at context 500 + 32 tokens on a 512-token model would stop early: refused."""
    target = make_checkpoint(tmp_path / "t-target", seed=0, max_position_embeddings=512)
    (tmp_path / "book.txt").write_text("word " * 2000)
    result = CliRunner().invoke(app, ["eval", "-m", str(target), "--books", str(tmp_path / "book.txt"),
                                      "--context", "500", "--gen-len", "32"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "exceeds the model's context (512 tokens)" in lines[0], result.stderr


def test_needle_prompts_generate_the_key_and_one_more_token():
    from tforce.eval.run import EvalConfig, Evaluator

    cfg = EvalConfig(tasks=["needle"], contexts=[64], policies=["retrieval"], budgets=[], chunk_sizes=[],
                     gamma1s=[], gamma2s=[], temperatures=[], gen_len=40)
    ev = Evaluator(None, None, None, [], cfg)
    assert ev._gen_len({"answer": [5, 6, 7, 8, 9]}) == 6
    assert ev._gen_len({"answer": None}) == 40
    cfg.needle_gen_len = 12
    assert ev._gen_len({"answer": [5, 6, 7, 8, 9]}) == 12



def test_eval_parts_and_reused_prefill(tmp_path):
    """--parts runs only the named measurements (report and figures follow); --reuse-prefill prefills each
    prompt once: 2 books + 9 needle depths at one context = 11 prefills for 11 x 5 policies + 1 triforce run."""
    target, books = _tiny_pair(tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "eval", "-m", str(target), "--books", str(books / "*.txt"), "--context", "120", "--budget", "32",
        "--gamma1s", "2", "--temperature", "0", "--gen-len", "4", "--sweep-prompts", "1", "--threads", "1",
        "--parts", "table1,gamma1", "--reuse-prefill", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout)
    assert {"table1", "gamma1"} <= set(res) and not {"budget", "chunk_size", "gamma2", "temperature", "speed"} & set(res)
    assert res["runs"] == 11 * 5 + 1 and res["prefills"] == 11
    assert sorted(p.name for p in out.glob("*.png")) == ["gamma1.png", "table1_policies.png"]
    md = (out / "results.md").read_text()
    assert "Table 1" in md and "gamma1" in md and "Speed" not in md and "Budget" not in md


def test_eval_refuses_unknown_parts(tmp_path):
    target, _ = _tiny_pair(tmp_path)
    result = CliRunner().invoke(app, ["eval", "-m", str(target), "--parts", "table1,tables"])
    assert result.exit_code == 2
    assert "--parts" in result.stderr


def test_reused_prefill_gives_the_same_runs(tmp_path):
    """A run that loads its prompt's KV cache (a snapshot of the first run's) generates the same tokens with
    the same acceptance as one that prefills, for every policy and for triforce."""
    from tforce.eval.run import EvalConfig, Evaluator
    from tforce.model.weights import load_model

    target, books = _tiny_pair(tmp_path)
    t = load_model(str(target), device="cpu")
    d = load_model(str(tmp_path / "t-draft"), device="cpu", tokenizer=False).model
    texts = [f.read_text() for f in sorted(books.glob("*.txt"))]
    cfg = EvalConfig(tasks=["pg19"], contexts=[160], policies=[], budgets=[], chunk_sizes=[], gamma1s=[],
                     gamma2s=[], temperatures=[], gen_len=12, budget=32, temperature=0.0)
    fresh = Evaluator(t.model, d, t.tokenizer, texts, cfg)
    kv = tmp_path / "kv"
    kv.mkdir()
    reused = Evaluator(t.model, d, t.tokenizer, texts, cfg, kv_dir=kv)
    ids = fresh.prompts("pg19", 160)[0]["ids"]
    reused.one(ids, policy="streaming")  # saves the snapshot
    for method, policy in [("retrieval", p) for p in ("retrieval", "shared", "topk", "streaming", "h2o")] + \
            [("triforce", "retrieval")]:
        a, b = fresh.one(ids, method=method, policy=policy), reused.one(ids, method=method, policy=policy)
        assert a["tokens"] == b["tokens"], (method, policy)
        assert (a["acceptance"], a["draft_acceptance"], a["tokens_per_verification"]) == \
            (b["acceptance"], b["draft_acceptance"], b["tokens_per_verification"]), (method, policy)
    assert reused.prefills == 1 and fresh.prefills == 6


def test_eval_without_books_says_how_to_give_them(tmp_path, monkeypatch):
    monkeypatch.delenv("TFORCE_BOOKS", raising=False)
    target = make_checkpoint(tmp_path / "t-target", seed=0)
    result = CliRunner().invoke(app, ["eval", "-m", str(target), "--context", "100"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "tforce: error: --books: give a glob of plain-text books (e.g. Project Gutenberg .txt files), or set "
        "TFORCE_BOOKS"]


@pytest.mark.parametrize("given", [True, False], ids=["--draft lookup", "registry default"])
def test_eval_with_lookup_runs_triforce_without_a_draft_model(tmp_path, monkeypatch, given):
    """`--draft lookup`, or a model whose registry draft is lookup (SmolLM2's): the gamma1 sweep and the
    speed comparison run triforce with lookup at the bottom level; no draft model is read."""
    import tforce.cli.eval as cli_eval
    from tforce.model.registry import LOOKUP

    target, books = _tiny_pair(tmp_path)
    if not given:
        monkeypatch.setattr(cli_eval, "default_draft", lambda model: LOOKUP)
    result = CliRunner().invoke(app, [
        "eval", "-m", str(target), "--books", str(books / "*.txt"), "--context", "120", "--budget", "32",
        "--gamma1s", "1,2", "--temperature", "0", "--gen-len", "4", "--sweep-prompts", "1", "--threads", "1",
        "--parts", "gamma1,speed", "--out", str(tmp_path / "out"), "--json", *(["--draft", "lookup"] if given else [])])
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout)
    assert res["draft"] == "lookup" and res["config"]["proposer"] == "lookup"
    assert [r["gamma1"] for r in res["gamma1"]] == [1, 2]
    assert {r["method"] for r in res["speed"]} == {"ar", "triforce"}
