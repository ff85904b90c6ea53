"""Stop strings: generation ends at the token whose text completes the first --stop string; the tokens are
an exact prefix of the run without it (greedy: plain decoding's; sampled: the same draws), the text ends
before the string, through generate, run (streamed and --json, one process and gloo ranks) and chat."""
from __future__ import annotations

import io
import json

import pytest

import tforce
from tforce.cli import app
from tforce.text.stream import TextStream
from tforce.engine.stops import StopStrings
from tforce.model.synthetic import byte_tokenizer
from tforce.engine.events import Events

from cli_helpers import FAST, one_error_line, run_pair
from cli_helpers import models, runner  # noqa: F401 (fixtures)

TOK = byte_tokenizer()


def test_cut_keeps_the_fewest_tokens_whose_text_holds_a_stop():
    ids = TOK.encode("one. two\n\nthree", add_special_tokens=False)
    stops = StopStrings(TOK, ["\n\n", "two"])
    k = stops.cut(ids)
    assert TOK.decode(ids[:k]) == "one. two" and stops.matched(ids) == "two"
    assert StopStrings(TOK, ["four"]).cut(ids) is None
    # the string that ends first wins, not the one listed first or starting first
    assert StopStrings(TOK, ["wo\n\nthree", "two"]).matched(ids) == "two"


def test_the_stream_never_shows_a_stop_string_or_what_follows():
    out = io.StringIO()
    stream = TextStream(TOK, out, stops=StopStrings(TOK, ["END"]))
    for piece in ["It was ", "the E", "N", "D of it"]:
        stream.add(TOK.encode(piece, add_special_tokens=False))
        assert "E" not in out.getvalue()  # "E" and "EN" may begin the stop string: held back
    assert stream.finish() == out.getvalue() == "It was the "
    held = TextStream(TOK, io.StringIO(), stops=StopStrings(TOK, ["END"]))
    held.add(TOK.encode("the E", add_special_tokens=False))
    assert held.finish() == "the E"  # at the end, a tail that never became the stop string is shown


@pytest.mark.parametrize("method", ["ar", "triforce", "retrieval", "naive", "streaming"])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_generate_ends_at_the_stop_with_an_exact_prefix(tiny, method, temperature):
    target, draft = tiny["gqa"], tiny["draft"]
    ids = TOK.encode("It was the best of times, it was the worst of times")
    kw = dict(draft=draft.model, method=method, max_new_tokens=40, temperature=temperature, seed=3, ignore_eos=True,
              budget=32, draft_budget=24, sinks=4)
    free = tforce.generate(target.model, ids, **kw).tokens
    text = TOK.decode(free, skip_special_tokens=True)
    stop = text[15:17]  # two characters from the middle of the text
    stops = StopStrings(TOK, [stop])
    k = stops.cut(free)
    assert k is not None and k < len(free)
    cut = tforce.generate(target.model, ids, events=Events(until=stops.cut), **kw).tokens
    assert cut == free[:k]


def test_run_text_ends_before_the_stop_streamed_and_as_json(runner, models):  # noqa: F811
    free = json.loads(run_pair(runner, models, str(models / "doc.txt"), *FAST, "--json", "-n", "24").stdout)
    stop = free["text"][6:8]
    first = free["text"].index(stop)
    r = run_pair(runner, models, str(models / "doc.txt"), *FAST, "--json", "-n", "24", "--stop", stop, "--stop", "\x01")
    assert r.exit_code == 0, (r.output, r.exception)
    obj = json.loads(r.stdout)
    assert obj["text"] == free["text"][:first] and obj["stopped_by"] == stop
    assert obj["tokens"] == free["tokens"][:len(obj["tokens"])] and len(obj["tokens"]) < len(free["tokens"])
    streamed = run_pair(runner, models, str(models / "doc.txt"), *FAST, "-n", "24", "--stop", stop)
    assert streamed.exit_code == 0 and streamed.stdout == free["text"][:first]
    ranks = run_pair(runner, models, str(models / "doc.txt"), *FAST, "--json", "-n", "24", "--stop", stop,
                     "--tp", "2", "--device", "cpu")
    assert ranks.exit_code == 0, (ranks.output, ranks.exception)
    assert json.loads(ranks.stdout)["tokens"] == obj["tokens"]


def test_chat_answers_end_at_the_stop(runner, models):  # noqa: F811
    base = ["chat", str(models / "doc.txt"), "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"),
            *FAST, "--json", "-n", "24", "--method", "triforce"]
    free = [json.loads(line) for line in runner.invoke(app, base, input="Who?\nWhen?\n").stdout.splitlines()]
    stop = free[0]["answer"][5:7]
    r = runner.invoke(app, base + ["--stop", stop], input="Who?\nWhen?\n")
    assert r.exit_code == 0, (r.output, r.exception)
    for before, after in zip(free, (json.loads(line) for line in r.stdout.splitlines())):
        if stop in before["answer"]:
            assert after["answer"] == before["answer"][:before["answer"].index(stop)] and after["stopped_by"] == stop
            assert after["tokens"] == before["tokens"][:len(after["tokens"])]
        else:
            assert after["tokens"] == before["tokens"] and after["stopped_by"] is None


def test_an_empty_stop_is_refused_in_one_line(runner, models):  # noqa: F811
    one_error_line(run_pair(runner, models, "--stop", ""), 2, "--stop takes a non-empty string")


def test_stop_strings_take_the_escapes_a_shell_passes_as_typed():
    from tforce.cli.setup import unescape

    assert [unescape(s) for s in ["\\n\\n", "a\\tb", "\\\\n", "é\n", "\\x"]] == ["\n\n", "a\tb", "\\n", "é\n", "\\x"]
