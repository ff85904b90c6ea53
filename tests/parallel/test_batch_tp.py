"""A batch with the target split over ranks (parallel/tp.py generate_batch_tp, `tforce run --batch --tp N`):
gloo on the CPU, 2 spawned processes. Every rank runs the whole batch on its KV heads; the rows are the
one-process batch's, greedy token for token and sampled with the same seed (the ranks' logits match the
unsharded model's up to summation order, as for one prompt: tests/parallel/test_parallel.py)."""
from __future__ import annotations

import json

from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.parallel.tp import generate_batch_tp
from tforce.config import RunConfig
from tforce.engine.events import Events

from model_helpers import random_ids
from tp_helpers import GEN
from tp_helpers import paths, single  # noqa: F401 (fixtures)

PROMPTS = [random_ids(n, seed=n)[0].tolist() for n in (48, 9, 30)]  # ragged rows
BATCH = dict(GEN, max_new_tokens=[16, 6, 12])


def test_split_batch_rows_are_the_one_process_rows(paths, single):  # noqa: F811
    """Greedy triforce and sampled naive rows in one launch each; rows finish at different rounds."""
    target, draft = single
    rows = {}
    for method, sampling in (("triforce", dict(temperature=0)), ("naive", dict(temperature=0.9, seed=77))):
        done = []
        got = generate_batch_tp(paths[0], paths[1], PROMPTS, 2, "cpu", method=method,
                                events=Events(on_row=lambda r, t: done.append(r)), **sampling, **BATCH)
        want = tforce.generate_batch(target, PROMPTS, draft=draft, method=method, **sampling, **BATCH)
        assert [r.tokens for r in got] == [r.tokens for r in want]
        assert sorted(done) == [0, 1, 2]  # rank 0's on_row events reach this process
        rows[method] = got
    greedy = [tforce.generate(target, p, draft=draft, method="ar", temperature=0, **dict(GEN, max_new_tokens=n)).tokens
              for p, n in zip(PROMPTS, BATCH["max_new_tokens"])]
    assert [r.tokens for r in rows["triforce"]] == greedy
    assert all(len(r.tokens) == n for r, n in zip(rows["naive"], BATCH["max_new_tokens"]))


def test_cli_batch_with_tp2(paths, single, tmp_path):  # noqa: F811
    target, draft = single
    tok = tforce.load_model(str(paths[0]), tokenizer=True).tokenizer
    texts = ["It was the best of times, it was the worst of times.", "Call me Ishmael."]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(texts)))
    args = ["run", "-m", str(paths[0]), "--draft", str(paths[1]), "--batch", str(batch), "--tp", "2", "--device",
            "cpu", "-t", "0", "-n", "16", "--budget", "32", "--chunk-size", "4", "--draft-budget", "16", "--sinks", "2",
            "--ignore-eos", "--method", "triforce"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    for line, text in zip(lines, texts):
        assert line["tokens"] == tforce.generate(target, tok.encode(text), draft=draft, temperature=0, **GEN).tokens
    assert "batch of 2 prompts" in result.stderr


def test_a_batch_the_ranks_refuse_runs_as_smaller_batches(paths, single, tmp_path, monkeypatch):  # noqa: F811
    """Under --tp the ranks plan the file's batch (the CLI's check plans one process, not a rank's shard):
    when they refuse it (DoesNotFit, raised here as such: test_parallel.py), it runs halved, each half
    again on ranks, every row as alone. The refusal is stood in for in this process for batches of more
    than one row."""
    import tforce.parallel.tp as tp
    from tforce.errors import DoesNotFit

    target, draft = single
    real, tried = tp.generate_batch_tp, []

    def refusing(model, draft_path, prompts, *args, **kwargs):
        tried.append(len(prompts))
        if len(prompts) > 1:
            raise DoesNotFit("not enough GPU memory: stand-in")
        return real(model, draft_path, prompts, *args, **kwargs)

    monkeypatch.setattr(tp, "generate_batch_tp", refusing)
    tok = tforce.load_model(str(paths[0]), tokenizer=True).tokenizer
    texts = ["It was the best of times.", "Call me Ishmael."]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(texts)))
    args = ["run", "-m", str(paths[0]), "--batch", str(batch), "--tp", "2", "--device", "cpu", "-t", "0", "-n", "8",
            "--ignore-eos", "--method", "ar"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert tried == [2, 1, 1]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["id"] for line in lines] == [0, 1]
    for line, text in zip(lines, texts):
        assert line["tokens"] == tforce.generate(target, tok.encode(text), method="ar", temperature=0,
                                                 max_new_tokens=8, ignore_eos=True).tokens
    assert "prompts 1-2 do not fit together after all (not enough GPU memory: stand-in)" in result.stderr


def test_a_cuda_launchs_options_are_generate_batchs(single):  # noqa: F811
    """A CUDA launch runs the ranks eager (tp_options: cuda_graphs=False, no all_reduce inside a captured
    graph): generate_batch takes that option, as generate does (checked on the CPU, where it does nothing)."""
    from tforce.parallel.tp import tp_options

    _, config, _ = tp_options("cuda", None, RunConfig.of(method="ar", max_new_tokens=4, temperature=0), 2)
    assert config.execution.cuda_graphs is False
    rows = tforce.generate_batch(single[0], PROMPTS[:2], config)
    assert [len(r.tokens) for r in rows] == [4, 4]
