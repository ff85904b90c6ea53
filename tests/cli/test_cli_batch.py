"""`tforce run --batch FILE.jsonl` through Typer's CliRunner: one JSON line per prompt in the file's order,
each the target's greedy continuation of that prompt alone; every bad line is one error naming it."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tforce.cli import app

from cli_helpers import DOC, FAST, expected_tokens, one_error_line, run_pair
from cli_helpers import models  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def _write(tmp_path, *lines: str):
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("method, offload", [("ar", "auto"), ("naive", "auto"), ("ar", "on"), ("triforce", "auto"),
                                            ("triforce", "on"), ("retrieval", "auto"), ("streaming", "auto")])
def test_batch_lines_match_each_prompt_alone(runner, models, tmp_path, method, offload):
    batch = _write(tmp_path, json.dumps({"prompt": "It was", "id": "short"}), "",
                   json.dumps({"file": str(models / "doc.txt"), "prompt": "Who?"}),
                   json.dumps({"prompt": DOC, "id": 7, "max_new_tokens": 5}))
    r = run_pair(runner, models, "--batch", batch, "--method", method, "--offload", offload, *FAST)
    assert r.exit_code == 0, r.output
    out = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [o["id"] for o in out] == ["short", 3, 7]  # the line number when no id is given
    for o, text, n in zip(out, ["It was", DOC + "\n\nWho?", DOC], [12, 12, 5]):
        assert o["tokens"] == expected_tokens(models, text, n)
        assert o["method"] == method and o["stats"]["batch_size"] == 3
        assert o["stats"]["kv_offloaded_layers"] == (2 if offload == "on" else 0)
    assert "batch of 3 prompts" in r.stderr and "ms/token for the batch" in r.stderr
    assert ("retrieval rebuilds" in r.stderr) == (method == "triforce" or method == "retrieval")
    for o in out:
        assert o["stats"]["tokens_per_verification"] > 0 and o["stats"]["ms_per_token"] > 0


def test_batch_with_the_h2o_policy_matches_each_prompt_alone(runner, models, tmp_path):
    """--policy h2o with --batch: the two longer prompts exceed the middle budget (16), so each row selects
    by its own prompt's heavy hitters; every line is plain decoding of its prompt, and its acceptance and
    rebuilds are those of `tforce run` of that prompt alone."""
    texts = ["It was", DOC + "\n\nWho?", DOC]
    batch = _write(tmp_path, *(json.dumps({"prompt": t}) for t in texts))
    opts = ["--method", "triforce", "--policy", "h2o", *FAST, "--budget", "16", "--chunk-size", "4",
            "--rebuild-every", "4"]
    r = run_pair(runner, models, "--batch", batch, *opts)
    assert r.exit_code == 0, r.output
    out = [json.loads(line) for line in r.stdout.strip().splitlines()]
    for o, text in zip(out, texts):
        assert o["tokens"] == expected_tokens(models, text)
        one = run_pair(runner, models, "--prompt", text, "--json", *opts)
        assert one.exit_code == 0, one.output
        alone = json.loads(one.stdout)["stats"]
        for key in ("acceptance", "rebuilds", "verifications"):
            assert o["stats"][key] == alone[key], key
    assert max(o["stats"]["rebuilds"] for o in out) > 0


def test_json_is_one_object_holding_the_lines(runner, models, tmp_path):
    """--json with --batch was ignored (JSON lines came out): it prints one object, the per-prompt records
    exactly as the lines give them, in the file's order, and the batch's figures the summary line reports."""
    batch = _write(tmp_path, json.dumps({"prompt": "It was", "id": "short"}), json.dumps({"prompt": DOC, "id": 7}))
    lines = run_pair(runner, models, "--batch", batch, "--method", "triforce", *FAST)
    one = run_pair(runner, models, "--batch", batch, "--method", "triforce", "--json", *FAST)
    assert lines.exit_code == one.exit_code == 0, one.output
    [obj] = [json.loads(line) for line in one.stdout.strip().splitlines()]
    records = [json.loads(line) for line in lines.stdout.strip().splitlines()]
    timing = ("prefill_s", "decode_s", "batch_tokens_per_s", "ms_per_token", "prefill_rebuild_s", "rebuild_s",
              "stage_s", "ttft_s")  # measured: they differ between the two runs

    def untimed(stats):
        return {k: v for k, v in stats.items() if k not in timing}

    assert [(r["id"], r["tokens"], untimed(r["stats"])) for r in obj["results"]] == \
        [(r["id"], r["tokens"], untimed(r["stats"])) for r in records]
    assert [{k: v for k, v in r.items() if k != "stats"} for r in obj["results"]] == \
        [{k: v for k, v in r.items() if k != "stats"} for r in records]
    first = obj["results"][0]["stats"]
    assert obj["method"] == "triforce" and obj["device"] == "cpu" and obj["complete"] is True
    assert obj["stats"] == {"new_tokens": sum(len(r["tokens"]) for r in records), "batches": 1,
                            **{k: first[k] for k in ("batch_size", "prefill_s", "decode_s", "batch_tokens_per_s",
                                                     "ms_per_token", "prefill_rebuild_s", "rebuild_s")}}
    assert obj["stats"]["batch_size"] == 2 and "batch of 2 prompts" not in one.stderr


@pytest.mark.parametrize("line, needle", [
    ("not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: expected an object"),
    ('{"text": "x"}', "line 2: unknown key(s) text"),
    ('{"prompt": "b", "max_new_tokens": -1}', 'line 2: "max_new_tokens" must be an integer >= 0'),
    ('{"id": "x"}', 'line 2: give "prompt"'),
    ('{"prompt": 3}', 'line 2: "prompt" must be a string'),
    ('{"prompt": "  "}', "line 2: the prompt is empty"),
    ('{"file": "/no/such/file"}', "line 2: cannot read /no/such/file"),
    ('{"prompt": "b", "id": "a"}', "line 2: id 'a' is line 1's id"),
    ('{"prompt": "b", "id": [1]}', 'line 2: "id" must be a string or an integer'),
])
def test_a_bad_line_is_one_error_naming_it(runner, models, tmp_path, line, needle):
    batch = _write(tmp_path, '{"prompt": "ok", "id": "a"}', line)
    one_error_line(run_pair(runner, models, "--batch", batch, "--method", "ar", *FAST), 2, needle)


def test_batch_refusals(runner, models, tmp_path):
    batch = _write(tmp_path, '{"prompt": "ok"}')
    one_error_line(run_pair(runner, models, "--batch", batch, "--method", "ar", "-p", "x", *FAST), 2,
                   "no PROMPT_FILE or --prompt")
    one_error_line(run_pair(runner, models, "--batch", str(tmp_path / "none.jsonl"), "--method", "ar", *FAST), 2,
                   "cannot read batch file")
    one_error_line(run_pair(runner, models, "--batch", batch, "--method", "ar", "--save-kv", str(tmp_path / "kv"),
                            *FAST), 2, "--batch saves no KV snapshot")
    assert not (tmp_path / "kv").exists()
    empty = _write(tmp_path, "", "  ")
    one_error_line(run_pair(runner, models, "--batch", empty, "--method", "ar", *FAST), 2, "holds no prompts")
    # the one method check of batches (engine.batch.check_batchable), as bench's below and generate_batch's
    one_error_line(run_pair(runner, models, "--batch", batch, "--method", "beam", *FAST), 2,
                   "--batch runs --method ar|triforce|naive|retrieval|streaming, not 'beam'")


def test_bench_batch_against_one_at_a_time(runner):
    r = runner.invoke(app, ["bench", "--synthetic", "tiny", "--device", "cpu", "--batch", "3", "--prompt-len", "40",
                            "--gen-len", "8", "--temperature", "0", "--draft-budget", "24", "--budget", "32",
                            "--chunk-size", "4", "--json"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["batch"] == 3 and obj["synthetic"]
    assert [run["method"] for run in obj["runs"]] == ["ar", "triforce", "naive"]  # the default methods
    for run in obj["runs"]:
        assert run["rows_equal_alone"] is True and run["tokens"] == 3 * 8
        assert run["batch_tokens_per_s"] > 0 and run["one_at_a_time_tokens_per_s"] > 0
        assert run["ms_per_token"] == pytest.approx(1000 / run["batch_tokens_per_s"])
        assert len(run["tokens_per_verification"]) == 3 and min(run["tokens_per_verification"]) >= 1
        assert (run["rebuild_s"] is None) == (run["prefill_rebuild_s"] is None) == (run["method"] != "triforce")
        assert run["gpu_mem_gib"] is None and run["gpu_reserved_gib"] is None and run["planned_peak_gib"] > 0
        nodes = {"ar": {"full"}, "triforce": {"draft", "retrieval", "full"}, "naive": {"draft", "full"}}[run["method"]]
        for key in ("forwards", "stage_s", "one_at_a_time_forwards", "one_at_a_time_stage_s"):
            assert set(run[key]) == nodes and min(run[key].values()) > 0, key
        # the rows decode together: fewer forwards than alone, each row's tokens the same
        assert run["forwards"]["full"] < run["one_at_a_time_forwards"]["full"]
        # each node's forwards beside their floor at the rows they fed: up to 3 in the batch, 1 alone
        batch, alone = run["floors"], run["one_at_a_time_floors"]
        assert set(batch["step_floor_ms"]) == set(alone["step_floor_ms"]) == nodes
        assert all(1 <= x <= 3 for x in batch["rows_per_forward"].values())
        assert set(alone["rows_per_forward"].values()) == {1}
        if run["method"] == "ar":  # one token per row and step: the rows finish together
            assert batch["rows_per_forward"]["full"] == 3
        for name in nodes:
            assert batch["step_ms"][name] == pytest.approx(1000 * run["stage_s"][name] / run["forwards"][name])
            more = batch["rows_per_forward"][name] > 1  # more rows' KV beside the same weights (test_floors.py)
            assert batch["step_floor_ms"][name] > alone["step_floor_ms"][name] if more else \
                batch["step_floor_ms"][name] == pytest.approx(alone["step_floor_ms"][name])
        # the stage times projected at the paper's acceptance, the batch's as 3 rows (projection.py)
        p = run["projection"]
        assert p["acceptance"] == 0.92 and p["batch"]["rows"] == 3 and p["one_at_a_time"]["rows"] == 1
        assert p["speedup_vs_one_at_a_time"] == pytest.approx(
            p["one_at_a_time"]["ms_per_token"] / p["batch"]["ms_per_token"])
    text = runner.invoke(app, ["bench", "--synthetic", "tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "20",
                               "--gen-len", "4", "--methods", "ar,triforce"], env={"COLUMNS": "200"})
    assert text.exit_code == 0 and "tforce bench --batch 2" in text.stdout and "one at a time" in text.stdout
    assert "per forward, ms: measured = floor" in text.stdout and "triforce, batch: draft " in text.stdout
    assert "projected from these stage times (NOT measured" in text.stdout
    assert "triforce at acceptance 0.92" in text.stdout
    assert "triforce" in text.stdout


def test_bench_batch_times_row_wise_verification(runner, monkeypatch):
    """A method ending in +det runs the batch and each prompt alone with --deterministic; greedy rows equal."""
    import tforce.engine.session
    from tforce.engine.rowwise import RowwiseRunner

    rows = []  # the rows of every session verifying row by row
    monkeypatch.setattr(tforce.engine.nodes, "RowwiseRunner",
                        lambda model, cache: rows.append(cache.rows) or RowwiseRunner(model, cache))
    r = runner.invoke(app, ["bench", "--synthetic", "tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "30",
                            "--gen-len", "6", "--temperature", "0", "--budget", "16", "--chunk-size", "4",
                            "--draft-budget", "24", "--methods", "ar,triforce+det", "--json"])
    assert r.exit_code == 0, r.output
    runs = json.loads(r.stdout)["runs"]
    assert [run["method"] for run in runs] == ["ar", "triforce+det"] and all(run["rows_equal_alone"] for run in runs)
    assert 2 in rows and 1 in rows  # the batch's session (warm-up and timed) and the prompts alone


def test_bench_batch_refusals(runner):
    r = runner.invoke(app, ["bench", "--synthetic", "tiny", "--batch", "2", "--methods", "ar,auto+det"])
    one_error_line(r, 2, "--batch runs --method ar|triforce|naive|retrieval|streaming (each may end in +det)")
    one_error_line(runner.invoke(app, ["bench", "--synthetic", "tiny", "--batch", "0"]), 2, "--batch must be >= 1")


def test_batch_from_stdin(runner, models):
    r = run_pair(runner, models, "--batch", "-", "--method", "ar", *FAST, input='{"prompt": "It was", "id": "x"}\n')
    assert r.exit_code == 0, r.output
    [line] = r.stdout.strip().splitlines()
    assert json.loads(line)["id"] == "x" and json.loads(line)["tokens"] == expected_tokens(models, "It was")


def test_lines_are_split_at_newlines_only(tmp_path):
    """JSON may hold U+2028, U+2029 and U+0085 unescaped in a string (json.dumps(..., ensure_ascii=False)
    writes them so); str.splitlines() also splits there, which broke such a line into two that are not
    JSON. Lines end at \\n (a \\r before it is dropped), and the line numbers of errors count those."""
    from tforce.cli.batch_run import read_batch
    from tforce.errors import UsageError

    texts = ["one\u2028two", "three\u2029four\x85five"]
    path = tmp_path / "batch.jsonl"
    path.write_bytes(("\r\n".join(json.dumps({"prompt": t}, ensure_ascii=False) for t in texts) + "\r\n").encode())
    assert read_batch(str(path)) == [(1, texts[0], None), (2, texts[1], None)]
    path.write_text(json.dumps({"prompt": texts[0]}, ensure_ascii=False) + "\nnot json\n")
    with pytest.raises(UsageError, match="line 2: not JSON"):
        read_batch(str(path))


@pytest.mark.parametrize("failure, code", [(KeyboardInterrupt, 130), (RuntimeError("out of memory"), 1)])
@pytest.mark.parametrize("as_json", [False, True])
def test_rows_finished_before_an_interrupt_or_error_are_written(runner, models, tmp_path, monkeypatch, failure,
                                                                code, as_json):
    """Results went to stdout only after the whole batch: Ctrl-C or an error half way lost every finished
    row (and with --batch -, the prompts were gone too). The rows finished so far are written, in the
    file's order, with "stats": null (the batch's were not measured to its end); the others are not."""
    import tforce.engine.session

    calls = []
    real = tforce.engine.session.Session.round

    def failing(self, n, gen):
        calls.append(1)
        if len(calls) == 3:
            raise failure
        return real(self, n, gen)

    monkeypatch.setattr(tforce.engine.session.Session, "round", failing)
    batch = _write(tmp_path, json.dumps({"prompt": DOC, "id": "long"}),
                   json.dumps({"prompt": "It was", "id": "one", "max_new_tokens": 1}),
                   json.dumps({"prompt": "It is", "id": "none", "max_new_tokens": 0}))
    r = run_pair(runner, models, "--batch", batch, "--method", "ar", *FAST, *(["--json"] if as_json else []))
    assert r.exit_code == code, r.output
    out = [json.loads(line) for line in r.stdout.strip().splitlines()]
    if as_json:  # one object: the same rows, and no batch figures
        [whole] = out
        assert whole["complete"] is False and whole["stats"] is None
        out = whole["results"]
    assert [o["id"] for o in out] == ["one", "none"]
    assert out[0]["tokens"] == expected_tokens(models, "It was", 1) and out[1]["tokens"] == []
    assert all(o["stats"] is None for o in out)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    """Editors on Windows save UTF-8 with a BOM; json.loads refuses one, so the whole file was refused
    ("line 1: not JSON (Unexpected UTF-8 BOM ...)"). RFC 8259 lets a parser ignore it; it is dropped."""
    from tforce.cli.batch_run import read_batch

    path = tmp_path / "batch.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a"}\n{"prompt": "b"}\n')
    assert read_batch(str(path)) == [(1, "a", None), (2, "b", None)]


def test_an_id_that_clashes_with_a_line_number_says_so(tmp_path):
    """A line without "id" is known by its line number; an earlier line's "id": 2 then clashed with line 2,
    whose error said "id 2 appears twice" of a line that gives no id."""
    from tforce.cli.batch_run import read_batch
    from tforce.errors import UsageError

    path = tmp_path / "batch.jsonl"
    path.write_text('{"prompt": "a", "id": 2}\n{"prompt": "b"}\n')
    with pytest.raises(UsageError, match=r'line 2: id 2 \(its line number, as it gives no "id"\) is line 1\'s id'):
        read_batch(str(path))
    path.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n')
    with pytest.raises(UsageError, match="line 2: id 'x' is line 1's id"):
        read_batch(str(path))


def test_a_row_the_context_cuts_short_is_noted(runner, models, tmp_path):
    """`tforce run` notes on stderr when the context leaves room for fewer new tokens than asked; a batch
    cut such a row short silently. One note names the rows and what they get."""
    long = "x" * 505
    batch = _write(tmp_path, json.dumps({"prompt": long, "id": "long"}), json.dumps({"prompt": "It was", "id": "s"}))
    r = run_pair(runner, models, "--batch", batch, "--method", "ar", *FAST)
    assert r.exit_code == 0, r.output
    out = [json.loads(line) for line in r.stdout.strip().splitlines()]
    room = 512 - out[0]["prompt_tokens"]
    assert 0 < room < 12 and len(out[0]["tokens"]) == room and len(out[1]["tokens"]) == 12
    notes = [line for line in r.stderr.splitlines() if "note:" in line]
    assert notes == [f"tforce: note: the model's context (512 tokens) leaves room for fewer new tokens than asked: "
                     f"'long' gets {room}"]


def test_batch_note_on_greedy_in_16_bits_offers_deterministic(runner, models, tmp_path):
    """A batch's exactness note offers --deterministic, which batches run now; with it there is no note."""
    batch = _write(tmp_path, json.dumps({"prompt": "Who?"}))
    args = ("--batch", batch, *FAST, "-n", "2", "--dtype", "bfloat16", "--device", "cpu", "--method", "triforce")
    r = run_pair(runner, models, *args)
    assert r.exit_code == 0, (r.output, r.exception)
    assert "except where its two best logits nearly tie; --deterministic makes them" in r.stderr, r.stderr
    r = run_pair(runner, models, *args, "--deterministic")
    assert r.exit_code == 0 and "nearly tie" not in r.stderr, (r.output, r.exception)


@pytest.mark.parametrize("offload", ["auto", "on"])
def test_deterministic_batch_rows_are_ar_alone_in_bfloat16(runner, models, tmp_path, monkeypatch, offload):
    """`run --batch --deterministic`: each line's tokens are greedy `ar` of that prompt alone in bfloat16
    (prompts of different lengths and budgets; tests/engine/test_rows_deterministic.py checks the logits bit for
    bit), the full cache verifying row by row (one RowwiseRunner for the batch)."""
    import torch

    import tforce
    from model_helpers import count_rowwise_runners

    built = count_rowwise_runners(monkeypatch)
    texts, budgets = ["It was", DOC + "\n\nWho?", DOC], [12, 12, 5]
    batch = _write(tmp_path, *(json.dumps({"prompt": t, "max_new_tokens": n}) for t, n in zip(texts, budgets)))
    r = run_pair(runner, models, "--batch", batch, "--deterministic", "--dtype", "bfloat16", "--device", "cpu",
                 "--offload", offload, *FAST)
    assert r.exit_code == 0, (r.output, r.exception)
    assert built == [1]
    out = [json.loads(line) for line in r.stdout.strip().splitlines()]
    target = tforce.load_model(str(models / "tiny-target"), dtype=torch.bfloat16)
    for o, text, n in zip(out, texts, budgets):
        ar = tforce.generate(target.model, target.tokenizer.encode(text), method="ar", max_new_tokens=n,
                             temperature=0)
        assert o["tokens"] == ar.tokens and len(ar.tokens) == n
        assert o["stats"]["kv_offloaded_layers"] == (2 if offload == "on" else 0)
