"""Chat templates that write the date (text/dates.py, PromptFormat.as_made): a KV snapshot made on one
day is reused on another in its own date, which its cache was computed with, by `chat` and `run`."""
from __future__ import annotations

import json
from datetime import datetime

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

import tforce
import tforce.text.format
from tforce.cli import app
from tforce.errors import UsageError
from tforce.text.format import PromptFormat
from tforce.text.dates import date_in

from cli_helpers import DOC, FAST, one_error_line
from template_helpers import HEADERS, templated_pair, tokenizer_with

# Llama 3.2's way with the date (strftime_now when transformers gives it), in HEADERS' layout
DATED = ("{{ bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
         "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
         "{%- endif %}{%- endif %}<|system|>\n\nToday Date: {{ date_string }}<|eot|>"
         "{% for m in messages %}<|{{ m['role'] }}|>\n\n{{ m['content'] | trim }}<|eot|>{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n\n{% endif %}")
DAY1, DAY2 = datetime(2026, 1, 5, 9, 30), datetime(2026, 3, 19, 23, 59)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_snapshot_of_another_day_is_laid_out_on_its_date(system):
    tok = tokenizer_with(DATED)
    day1, day2 = (PromptFormat(tok, system=system, now=d) for d in (DAY1, DAY2))
    doc = day1.document_ids(DOC)
    assert "Today Date: 05 Jan 2026" in tok.decode(doc) and day2.document_ids(DOC) != doc
    with pytest.raises(UsageError, match="on another day"):
        day2.check_document(doc, "the snapshot")
    made = day2.as_made(doc)
    assert made.snapshot_date == "05 Jan 2026" and made.now.date() == DAY1.date()
    made.check_document(doc, "the snapshot")
    assert doc + made.question_ids("Who?") == day1.prompt_ids(DOC + "\n\nWho?")
    assert made.prompt_ids(DOC + "\n\nWho?") == day1.prompt_ids(DOC + "\n\nWho?")
    assert day1.as_made(doc) is day1 and day1.snapshot_date is None  # the same day: nothing to change


def test_a_format_keeps_one_date_for_its_life(monkeypatch):
    """A chat that starts before midnight lays its later questions out in the same date as its document."""
    fmt = PromptFormat(tokenizer_with(DATED), now=DAY1)
    before = fmt.prompt_ids("x")
    _on(monkeypatch, DAY2)
    assert fmt.prompt_ids("x") == before
    assert PromptFormat(tokenizer_with(DATED)).prompt_ids("x") != before  # a new format takes the clock's date


def test_no_date_read_where_the_template_writes_none_or_the_text_is_another():
    tok = tokenizer_with(HEADERS)
    fmt = PromptFormat(tok)
    raw = tok.encode(DOC + "\n\n")
    assert fmt.as_made(raw) is fmt
    with pytest.raises(UsageError) as refused:
        fmt.check_document(raw, "the snapshot")
    assert "another day" not in str(refused.value)
    dated = PromptFormat(tokenizer_with(DATED), now=DAY1)
    assert dated.as_made(raw) is dated  # a raw snapshot holds no date: the check refuses it as before
    assert date_in(dated._head_with, "<s>something else") is None
    assert date_in(dated._head_with, dated._head_with(DAY2.strftime) + DOC).date() == DAY2.date()
    assert date_in(fmt._head_with, fmt._head) is None


# ----------------------------------------------------------------------------------- the commands

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return templated_pair(tmp_path_factory.mktemp("dated"), DATED, "target", "draft")


def _on(monkeypatch, day: datetime) -> None:
    """The clock PromptFormat reads says `day`."""
    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return day

    monkeypatch.setattr(tforce.text.format, "datetime", Clock)


def _cli(models, *args, input=None):
    base = ["-m", str(models / "target"), "--draft", str(models / "draft"), *FAST, "--method", "triforce"]
    return CliRunner().invoke(app, [args[0], *base, *args[1:]], input=input)


def _greedy(models, ids: list[int]) -> list[int]:
    target = tforce.load_model(str(models / "target"))
    return tforce.generate(target.model, ids, method="ar", max_new_tokens=12, temperature=0).tokens


def test_chat_and_run_reuse_a_snapshot_made_on_another_day(models, tmp_path, monkeypatch):
    """Before: chat refused the snapshot (blaming --template or --system), run reused only the tokens before
    the date and prefilled the rest."""
    tok = AutoTokenizer.from_pretrained(models / "target")
    _on(monkeypatch, DAY1)
    made = _cli(models, "chat", str(models / "doc.txt"), "--save-kv", str(tmp_path / "chat-kv"), input="")
    assert made.exit_code == 0, (made.output, made.exception)
    made = _cli(models, "run", str(models / "doc.txt"), "-p", "Who?", "-n", "1", "--save-kv", str(tmp_path / "run-kv"))
    assert made.exit_code == 0, (made.output, made.exception)
    day1 = PromptFormat(tok, now=DAY1).prompt_ids(DOC + "\n\nWho?")

    _on(monkeypatch, DAY2)
    r = _cli(models, "chat", "--load-kv", str(tmp_path / "chat-kv"), "--json", input="Who?\n")
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout)["tokens"] == _greedy(models, day1)
    note = "tforce: the chat template writes the date: the prompt has the KV snapshot's (05 Jan 2026)"
    assert note in r.stderr
    r = _cli(models, "run", str(models / "doc.txt"), "-p", "Who?", "--load-kv", str(tmp_path / "run-kv"), "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout)["tokens"] == _greedy(models, day1)
    # the same prompt: all of it but its last token, fed again for the first new token's distribution
    assert f"reused {len(day1) - 1} of {len(day1)} prompt tokens" in r.stderr and note in r.stderr
    fresh = _cli(models, "run", str(models / "doc.txt"), "-p", "Who?", "--json")  # no snapshot: today's date
    assert json.loads(fresh.stdout)["prompt_tokens"] == len(PromptFormat(tok, now=DAY2).prompt_ids(DOC + "\n\nWho?"))
    assert "writes the date" not in fresh.stderr


def test_a_templated_chat_still_refuses_a_raw_snapshot_in_one_line(models, tmp_path):
    raw = _cli(models, "run", str(models / "doc.txt"), "--template", "none", "-n", "1", "--save-kv", str(tmp_path / "kv"))
    assert raw.exit_code == 0, (raw.output, raw.exception)
    one_error_line(_cli(models, "chat", "--load-kv", str(tmp_path / "kv"), input="Who?\n"), 2,
                   "or on another day (the template writes the date)")


@pytest.mark.parametrize("fmt, written", [("%Y-%m-%d", "2026-01-05"), ("%B %Y", "January 2026"), ("%H:%M", "09:30")])
def test_the_snapshot_date_is_said_as_the_template_writes_it(fmt, written):
    """stderr's note names what the snapshot's tokens hold: it said "05 Jan 2026" whatever the format, and
    "01 Jan 2026" for "January 2026" or "01 Jan 1900" for a time, which no prompt held."""
    tok = tokenizer_with(DATED.replace("%d %b %Y", fmt))
    doc = PromptFormat(tok, now=DAY1).document_ids(DOC)
    made = PromptFormat(tok, now=DAY2).as_made(doc)
    assert made.snapshot_date == written
    assert doc + made.question_ids("Who?") == PromptFormat(tok, now=DAY1).prompt_ids(DOC + "\n\nWho?")


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_template_none_refuses_a_templated_snapshot_of_another_day(monkeypatch, system):
    """--template none refuses a snapshot laid out in the template (README); it compared the template's
    opening through today's date, so one made on another day passed as raw text."""
    tok = tokenizer_with(DATED)
    doc = PromptFormat(tok, system=system, now=DAY1).document_ids(DOC)
    for day in (DAY1, DAY2):
        _on(monkeypatch, day)
        with pytest.raises(UsageError, match="begins with .* chat template"):
            PromptFormat(tok, "none").check_document(doc, "the snapshot")
    PromptFormat(tok, "none").check_document(tok.encode(DOC + "\n\n"), "the snapshot")  # raw text passes


def test_a_date_written_without_padding_is_read_back():
    """strftime's "%-d" (glibc: the day without its zero, "5 January 2026"), which strptime does not take:
    the date was not found and the snapshot refused as made on another day."""
    tok = tokenizer_with(DATED.replace("%d %b %Y", "%-d %B %Y"))
    doc = PromptFormat(tok, now=DAY1).document_ids(DOC)
    assert "Today Date: 5 January 2026" in tok.decode(doc)
    made = PromptFormat(tok, now=DAY2).as_made(doc)
    assert made.snapshot_date == "5 January 2026"
    made.check_document(doc, "the snapshot")
    assert doc + made.question_ids("Who?") == PromptFormat(tok, now=DAY1).prompt_ids(DOC + "\n\nWho?")


def test_renders_on_two_threads_leave_transformers_clock_as_it_was():
    """Two formats rendering at once (a library user's threads): the stand-in for transformers' clock was
    saved and put back by each, so when the first to start ended first, the second put the first's clock
    back for good: every later template in the process wrote the first's date."""
    import threading

    from transformers.utils import chat_template_utils

    real = chat_template_utils.datetime
    tok = tokenizer_with(DATED)
    inside, second_inside, first_done = threading.Event(), threading.Event(), threading.Event()

    def first_clock(fmt):
        inside.set()
        second_inside.wait(timeout=2)  # the second render starts while this one is inside
        return DAY1.strftime(fmt)

    def second_clock(fmt):
        second_inside.set()
        first_done.wait(timeout=2)  # ... and ends after it
        return DAY2.strftime(fmt)

    def first():
        fmt._render([{"role": "user", "content": "x"}], first_clock)
        first_done.set()

    fmt = PromptFormat(tok, now=DAY1)
    a = threading.Thread(target=first)
    try:
        a.start()
        assert inside.wait(timeout=5)
        text = fmt._render([{"role": "user", "content": "x"}], second_clock)
        a.join()
        assert chat_template_utils.datetime is real
        assert "Today Date: 19 Mar 2026" in text
    finally:
        chat_template_utils.datetime = real  # for the tests after this one
