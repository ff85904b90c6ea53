"""`tforce run --batch` with a file whose plan does not fit: consecutive batches of the most rows that fit,
each planned for its own rows, run one after another, each row what it is alone and the lines in the
file's order; a batch the engine refuses runs split smaller. "Does not fit" is made on the CPU by the host
memory the plan is checked against (cli.common._host_available), set between the needs of k and k + 1
rows as `tforce info` plans them."""
from __future__ import annotations

import json

import pytest
from transformers import AutoConfig
from typer.testing import CliRunner

import tforce
import tforce.engine.nodes
from tforce.bench.suite import info_plan
from tforce.cli import app
from tforce.errors import DoesNotFit

from cli_helpers import DOC, FAST, expected_tokens, one_error_line, run_pair
from cli_helpers import models  # noqa: F401 (fixture)

CONTEXT, BUDGET, N = 512, 64, 12  # the tiny target's context; FAST's --budget and -n
PROMPTS = [("a", DOC, N), ("b", "It was", 3), ("c", "It is", N), ("d", "It was the", 0), ("e", "Who?", N)]


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def _file(tmp_path, prompts) -> str:
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps({"id": key, "prompt": text, "max_new_tokens": n}) + "\n"
                            for key, text, n in prompts))
    return str(path)


def _need(models, tokens: int, rows: int, method: str) -> int:
    """Host bytes the CLI's check asks of `rows` rows of `tokens` tokens (float32 on the CPU)."""
    target, draft = (AutoConfig.from_pretrained(models / name) for name in ("tiny-target", "tiny-draft"))
    plan = info_plan(target, tokens, 4, None, 2**40, "auto", BUDGET, draft_config=draft, context_bytes=0,
                     attention="math", method=method, rows=rows)
    return plan["peak_bytes"] + plan["host_kv_bytes"]


def _longest(models, prompts) -> int:
    tok = tforce.load_model(str(models / "tiny-target")).tokenizer
    return max(len(ids) + min(n, CONTEXT - len(ids)) for ids, n in ((tok.encode(t), n) for _, t, n in prompts))


def _room_for(models, monkeypatch, prompts, rows: int, method: str = "ar") -> int:
    """Host memory for `rows` rows of the file's longest, not one more; the bytes set."""
    tokens = _longest(models, prompts)
    fits, over = _need(models, tokens, rows, method), _need(models, tokens, rows + 1, method)
    assert fits < over
    monkeypatch.setattr("tforce.cli.common._host_available", lambda: (fits + over) // 2)
    return (fits + over) // 2


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_a_batch_that_does_not_fit_runs_as_smaller_batches(runner, models, tmp_path, monkeypatch, method):
    """Five prompts, room for two rows of the longest (the first) but for three of the short ones: two
    batches (2, 3), each planned for its own longest row (every batch planned for the file's longest, as
    before, made three: 2, 2, 1), one note on stderr, every row the tokens of the unsplit batch and of
    `tforce run` on its prompt alone, in the file's order."""
    batch = _file(tmp_path, PROMPTS)
    whole = run_pair(runner, models, "--batch", batch, "--method", method, *FAST)
    room = _room_for(models, monkeypatch, PROMPTS, 2, method)
    assert _need(models, _longest(models, PROMPTS[2:]), 3, method) <= room
    split = run_pair(runner, models, "--batch", batch, "--method", method, *FAST)
    assert whole.exit_code == split.exit_code == 0, split.output
    lines = [json.loads(line) for line in split.stdout.strip().splitlines()]
    unsplit = [json.loads(line) for line in whole.stdout.strip().splitlines()]
    assert [o["id"] for o in lines] == [key for key, _, _ in PROMPTS]
    assert [o["tokens"] for o in lines] == [o["tokens"] for o in unsplit]
    for o, (_, text, n) in zip(lines, PROMPTS):
        assert o["tokens"] == expected_tokens(models, text, n)
    assert [o["stats"]["batch_size"] for o in lines] == [2, 2, 3, 3, 3]
    assert "tforce: the batch of 5 does not fit: running it as 2 batches of at most 3" in split.stderr.splitlines()
    assert "batch of 5 prompts in 2 batches of at most 3 (times summed)" in split.stderr
    assert "does not fit" not in whole.stderr and "batch of 5 prompts:" in whole.stderr
    alone = run_pair(runner, models, "-p", PROMPTS[2][1], "--method", method, *FAST, "--json")
    assert alone.exit_code == 0 and json.loads(alone.stdout)["tokens"] == lines[2]["tokens"]


def test_the_split_batches_figures_are_summed(runner, models, tmp_path, monkeypatch):
    """--json: the stats say how many batches ran; times and tokens are the batches' sums, tokens/s and
    ms/token over all batches' decode time."""
    _room_for(models, monkeypatch, PROMPTS, 2)
    r = run_pair(runner, models, "--batch", _file(tmp_path, PROMPTS), "--method", "triforce", "--json", *FAST)
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    stats, rows = obj["stats"], [o["stats"] for o in obj["results"]]
    firsts = [rows[0], rows[2]]  # one row of each batch (2 and 3 rows): a batch's figures are in each of its rows
    assert obj["complete"] is True and stats["batches"] == 2 and stats["batch_size"] == 3
    assert stats["new_tokens"] == sum(len(o["tokens"]) for o in obj["results"]) == 3 * N + 3
    for key in ("prefill_s", "decode_s", "prefill_rebuild_s", "rebuild_s"):
        assert stats[key] == pytest.approx(sum(f[key] for f in firsts))
    decoded = stats["new_tokens"] - sum(1 for o in obj["results"] if o["tokens"])  # each row's first: its prefill's
    assert stats["batch_tokens_per_s"] == pytest.approx(decoded / stats["decode_s"])
    assert stats["ms_per_token"] == pytest.approx(1000 * stats["decode_s"] / decoded)


@pytest.mark.parametrize("as_json", [False, True])
def test_an_interrupt_in_the_second_batch_writes_the_rows_finished(runner, models, tmp_path, monkeypatch, as_json):
    """Ctrl-C in the second of three batches: the first batch's rows and the second's finished one are
    written in the file's order (the third batch never ran), then the one-line error."""
    import tforce.engine.session

    real, batches, rounds = tforce.engine.session.Session.round, [], []  # rounds: begun, per batch

    def failing(self, n, gen):
        if not batches or batches[-1] is not self:  # the batches run one after another
            batches.append(self)
            rounds.append(0)
        rounds[-1] += 1
        if len(batches) == 2 and rounds[-1] == 3:
            raise KeyboardInterrupt
        return real(self, n, gen)

    prompts = [("a", "It was", 4), ("b", "It is", 2), ("c", DOC, N), ("d", "It was the", 1), ("e", "Who?", 3)]
    _room_for(models, monkeypatch, prompts, 2)
    monkeypatch.setattr(tforce.engine.session.Session, "round", failing)
    r = run_pair(runner, models, "--batch", _file(tmp_path, prompts), "--method", "ar", *FAST,
                 *(["--json"] if as_json else []))
    assert r.exit_code == 130, r.output
    out = [json.loads(line) for line in r.stdout.strip().splitlines()]
    if as_json:
        [whole] = out
        assert whole["complete"] is False and whole["stats"] is None
        out = whole["results"]
    assert [o["id"] for o in out] == ["a", "b", "d"]
    for o, (_, text, n) in zip(out, [prompts[0], prompts[1], prompts[3]]):
        assert o["tokens"] == expected_tokens(models, text, n) and o["stats"] is None
    note = "tforce: the batch of 5 does not fit: running it as 3 batches of at most 2"
    assert r.stderr.strip().splitlines() == [note, "tforce: interrupted"]


def test_a_prompt_that_does_not_fit_alone_is_refused(runner, models, tmp_path, monkeypatch):
    """Room for the short prompts together but not for the long one alone: refused before any weights
    are read, with the check's message for that one row (no split note)."""
    def no_loading(*a, **k):
        raise AssertionError("weights loaded")

    long, short = [("long", "x" * 400, N)], [("s1", "It was", N), ("s2", "It is", N)]
    prompts = short + long
    tokens = _longest(models, long)
    assert _need(models, _longest(models, short), 2, "ar") < _need(models, tokens, 1, "ar")
    monkeypatch.setattr("tforce.cli.common._host_available", lambda: _need(models, tokens, 1, "ar") - 1)
    monkeypatch.setattr("tforce.model.weights.load_model", no_loading)
    r = run_pair(runner, models, "--batch", _file(tmp_path, prompts), "--method", "ar", *FAST)
    one_error_line(r, 1, "not enough memory")
    assert f"KV cache for {tokens} tokens" in r.stderr


def test_split_batches_sample_with_their_own_seeds(runner, models, tmp_path, monkeypatch):
    """With --seed, batch g is seeded seed + g: one seed for all would give the same prompt the same
    sample in every batch. The run stays reproducible."""
    prompts = [("a", "It was", N), ("b", "It was", N)]
    _room_for(models, monkeypatch, prompts, 1)
    args = ["--batch", _file(tmp_path, prompts), "--method", "ar", *FAST, "--temperature", "1", "--seed", "7"]
    first, again = run_pair(runner, models, *args), run_pair(runner, models, *args)
    assert first.exit_code == again.exit_code == 0, first.output
    assert "running it as 2 batches of at most 1" in first.stderr
    rows, rerun = ([json.loads(line)["tokens"] for line in r.stdout.strip().splitlines()] for r in (first, again))
    assert rows[0] != rows[1] and rows == rerun
    top = run_pair(runner, models, *args[:-1], str(2**64 - 1))  # the second batch's seed is past torch's range
    assert top.exit_code == 0 and len(top.stdout.strip().splitlines()) == 2, top.output


def test_bench_batch_is_not_split(runner, monkeypatch):
    """`tforce bench --batch 3` times three rows together or nothing: with room for two it is refused."""
    from tforce.model.synthetic import make_config

    def no_building(*a, **k):
        raise AssertionError("models built")

    def need(rows):
        plan = info_plan(make_config("tiny"), 48, 4, None, 2**40, "auto", 32, context_bytes=0, attention="math",
                         method="ar", rows=rows)
        return plan["peak_bytes"] + plan["host_kv_bytes"]

    monkeypatch.setattr("tforce.cli.common._host_available", lambda: (need(2) + need(3)) // 2)
    monkeypatch.setattr("tforce.bench.suite.synthetic_pair", no_building)
    r = runner.invoke(app, ["bench", "--synthetic", "tiny", "--device", "cpu", "--batch", "3", "--prompt-len", "40",
                            "--gen-len", "8", "--budget", "32", "--chunk-size", "4", "--methods", "ar"])
    one_error_line(r, 1, "not enough memory")
    assert "KV cache for 3 x 48 tokens" in r.stderr


def _engine_refusing(monkeypatch, refuse) -> list[int]:
    """The engine's own plan (tforce.engine.nodes.plan_session) raises DoesNotFit for the work refuse(work) names. A stand-in:
    on the CPU the engine plans with the same figures as the CLI's check, so the two cannot be made to
    disagree (on CUDA they can: the engine measures the memory free when it runs each batch). The rows of
    every batch the engine planned, in order."""
    import tforce.engine.session

    real, planned = tforce.engine.nodes.plan_session, []

    def plan(target, draft, work, *args):
        planned.append(work.rows)
        if refuse(work):
            raise DoesNotFit("not enough GPU memory: stand-in")
        return real(target, draft, work, *args)

    monkeypatch.setattr(tforce.engine.nodes, "plan_session", plan)
    return planned


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_a_batch_the_engine_refuses_runs_split_smaller(runner, models, tmp_path, monkeypatch, method):
    """The CLI's check lets all five prompts through, the engine takes at most two rows: 5 is refused and
    runs as 2 + 3, the 3 as 1 + 2 (a note each time); every row is still its prompt alone, in the file's
    order, and the summary counts the three batches that ran."""
    planned = _engine_refusing(monkeypatch, lambda work: work.rows > 2)
    r = run_pair(runner, models, "--batch", _file(tmp_path, PROMPTS), "--method", method, *FAST)
    assert r.exit_code == 0, r.output
    assert planned == [5, 2, 3, 1, 2]
    lines = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [o["id"] for o in lines] == [key for key, _, _ in PROMPTS]
    for o, (_, text, n) in zip(lines, PROMPTS):
        assert o["tokens"] == expected_tokens(models, text, n)
    assert [o["stats"]["batch_size"] for o in lines] == [2, 2, 1, 2, 2]
    notes = [line for line in r.stderr.splitlines() if "after all" in line]
    assert notes == ["tforce: prompts 1-5 do not fit together after all (not enough GPU memory: stand-in): running "
                     "them as batches of 2 and 3",
                     "tforce: prompts 3-5 do not fit together after all (not enough GPU memory: stand-in): running "
                     "them as batches of 1 and 2"]
    assert "does not fit:" not in r.stderr and "batch of 5 prompts in 3 batches of at most 2" in r.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_a_prompt_the_engine_refuses_alone_ends_the_run_keeping_finished_rows(runner, models, tmp_path, monkeypatch,
                                                                             as_json):
    """The engine refuses every batch holding the long prompt, even alone: the rows finished before it are
    written (as after any failure half way), then its refusal as the one error line."""
    prompts = [("s1", "It was", N), ("s2", "It is", N), ("long", DOC, N), ("s3", "Who?", N)]
    longest = len(tforce.load_model(str(models / "tiny-target")).tokenizer.encode(DOC)) - 1
    planned = _engine_refusing(monkeypatch, lambda work: work.prompt >= longest)
    r = run_pair(runner, models, "--batch", _file(tmp_path, prompts), "--method", "ar", *FAST,
                 *(["--json"] if as_json else []))
    assert r.exit_code == 1, r.output
    assert planned == [4, 2, 2, 1]
    out = [json.loads(line) for line in r.stdout.strip().splitlines()]
    if as_json:
        [whole] = out
        assert whole["complete"] is False
        out = whole["results"]
    assert [(o["id"], o["stats"]) for o in out] == [("s1", None), ("s2", None)]
    assert out[0]["tokens"] == expected_tokens(models, "It was", N)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 3 and lines[-1] == "tforce: error: not enough GPU memory: stand-in", lines
    assert "Traceback" not in r.output
