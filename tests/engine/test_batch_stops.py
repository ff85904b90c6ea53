"""Stop strings in batches: each row of generate_batch(..., until=...) and of `tforce run --batch --stop` ends
where a single run of its prompt with the same stops ends (greedy: token for token; sampled: the exact
target distribution cut at the stop), its text ends before the string, and a row that stopped leaves the
batch as a row at EOS does."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import tforce
from tforce.engine.batch import generate_batch
from tforce.engine.stops import StopStrings
from tforce.model.synthetic import byte_tokenizer
from tforce.engine.events import Events

from cli_helpers import DOC, FAST, run_pair
from cli_helpers import models  # noqa: F401 (fixture)
from exactness_helpers import PROMPT, SAMPLING, SAMPLES, N_TOKENS, exact_joint
from model_helpers import record_host
from stats_util import chi2_pvalue

TOK = byte_tokenizer()
TEXTS = ["It was the best of times, it was the worst of times", "Who?", "It is a truth universally acknowledged"]
SMALL = dict(budget=32, chunk_size=4, draft_budget=24, sinks=4, gamma2=4, prefill_chunk=8)


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def stop_in(text: str, avoid: list[str], start: int = 8, width: int = 2) -> str:
    """`width` whole characters of text from `start` on that occur in no text of avoid."""
    for i in range(start, len(text) - width + 1):
        s = text[i:i + width]
        if "\ufffd" not in s and not any(s in other for other in avoid):
            return s
    raise AssertionError(f"no stop string in {text!r}")


@pytest.mark.parametrize("method", ["ar", "triforce", "naive", "streaming"])
def test_greedy_rows_end_at_their_stops_as_alone(tiny, method):
    """Rows 0 and 1 each hold a stop string (at different points), row 2 none: every row is the single
    run of its prompt with the same stops, token for token, and rows 0 and 1 are cut short."""
    target, draft = tiny["gqa"].model, tiny["draft"].model
    prompts = [TOK.encode(t) for t in TEXTS]
    kw = dict(draft=draft, method=method, max_new_tokens=30, temperature=0, ignore_eos=True, **SMALL)
    free = [tforce.generate(target, p, **kw).tokens for p in prompts]
    texts = [TOK.decode(f, skip_special_tokens=True) for f in free]
    stops = StopStrings(TOK, [stop_in(texts[0], texts[2:]), stop_in(texts[1], texts[2:], start=12)])
    cuts = [stops.cut(f) for f in free]
    assert cuts[0] < 30 and cuts[1] < 30 and cuts[0] != cuts[1] and cuts[2] is None
    rows = generate_batch(target, prompts, events=Events(until=stops.cut), **kw)
    for prompt, row, f, k in zip(prompts, rows, free, cuts):
        alone = tforce.generate(target, prompt, events=Events(until=stops.cut), **kw).tokens
        assert row.tokens == alone == f[:k]


def test_a_row_that_stops_leaves_the_batch(tiny, monkeypatch):
    """ar: one device -> host transfer per step carries every live row's token; from the step after the one
    whose token completes row 1's stop string the transfers carry two rows (its cache row compacted away,
    as at EOS), and on_row hears row 1 first, with its final tokens."""
    model = tiny["gqa"].model
    prompts = [TOK.encode(t) for t in TEXTS]
    kw = dict(method="ar", max_new_tokens=12, temperature=0, ignore_eos=True)
    free = [tforce.generate(model, p, **kw).tokens for p in prompts]
    texts = [TOK.decode(f, skip_special_tokens=True) for f in free]
    stops = StopStrings(TOK, [stop_in(texts[1], [texts[0], texts[2]], start=2)])
    k = stops.cut(free[1])
    assert 1 < k < 12
    calls, heard = record_host(monkeypatch), []
    rows = generate_batch(model, prompts, events=Events(until=stops.cut, on_row=lambda r, t: heard.append((r, t))), **kw)
    assert [r.tokens for r in rows] == [free[0], free[1][:k], free[2]]
    assert heard[0] == (1, free[1][:k])
    assert calls == [3] * k + [2] * (12 - k)


STOP = 3  # a token of the 6-token vocabulary drawn first by 5-53% of the rows' samples, later by more


def test_sampled_rows_cut_at_a_stop_follow_the_target(small_vocab):
    """triforce, three rows whose samples end at their first STOP token (until), so rows leave the batch
    at random rounds: each row's tokens follow the exact target distribution of its prompt alone, cut
    there (chi-square over the cut sequences, as tests/engine/test_batch.py tests rows without a stop)."""
    target, draft = small_vocab
    rows = [PROMPT, PROMPT[:9], PROMPT[:2]]

    def until(ids):
        return ids.index(STOP) + 1 if STOP in ids else None

    kw = dict(temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, top_k=SAMPLING.top_k, draft_budget=16, sinks=2,
              gamma2=3, budget=16, chunk_size=4, gamma1=2, ignore_eos=True, max_new_tokens=N_TOKENS)
    samples = [[] for _ in rows]
    for i in range(SAMPLES):
        for r, res in enumerate(generate_batch(target, rows, draft=draft, method="triforce", seed=7 * SAMPLES + i,
                                               events=Events(until=until), **kw)):
            samples[r].append(tuple(res.tokens))
    pvalues = []
    for prompt, got in zip(rows, samples):
        cut: dict[tuple, float] = {}
        for seq, p in exact_joint(target, prompt, N_TOKENS).items():
            key = seq[:until(list(seq)) or N_TOKENS]
            cut[key] = cut.get(key, 0.0) + p
        keys = sorted(cut)
        assert set(got) <= set(keys)
        pvalues.append(chi2_pvalue([got.count(k) for k in keys], [cut[k] for k in keys]))
        assert 0.05 < sum(len(s) < N_TOKENS for s in got) / SAMPLES < 0.95  # rows really leave early, not always
    assert min(pvalues) > 1e-3, pvalues


def test_run_batch_stop_lines_and_json_are_single_runs(runner, models, tmp_path):  # noqa: F811
    """`tforce run --batch F --stop A --stop B`: each record's text, tokens and stopped_by are those of
    `tforce run --json --stop A --stop B` on its prompt alone (two rows stopped, one that never meets a
    stop), as JSON lines and inside --json's one object."""
    texts = ["It was", DOC, "Who?"]

    def alone(*args):
        out = [run_pair(runner, models, "-p", t, *FAST, "--json", *args) for t in texts]
        assert all(r.exit_code == 0 for r in out), out[0].output
        return [json.loads(r.stdout) for r in out]

    free = [o["text"] for o in alone()]
    args = ["--stop", stop_in(free[0], free[2:], start=3), "--stop", stop_in(free[1], free[2:], start=5, width=1)]
    single = alone(*args)
    assert single[0]["stopped_by"] is not None and single[1]["stopped_by"] is not None
    assert single[2]["stopped_by"] is None and len(single[2]["tokens"]) == 12
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    lines = run_pair(runner, models, "--batch", str(path), *FAST, *args)
    one = run_pair(runner, models, "--batch", str(path), *FAST, "--json", *args)
    assert lines.exit_code == one.exit_code == 0, (lines.output, one.output)
    for records in ([json.loads(line) for line in lines.stdout.splitlines()], json.loads(one.stdout)["results"]):
        assert [r["id"] for r in records] == [0, 1, 2]
        for got, want in zip(records, single):
            assert (got["text"], got["tokens"], got["stopped_by"]) == (want["text"], want["tokens"],
                                                                      want["stopped_by"])
        assert args[1] not in records[0]["text"] and len(records[0]["tokens"]) < 12
