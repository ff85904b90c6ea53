"""What `tforce serve` answers is what `tforce run` prints: temperature-0 completions and chat completions
(through the chat template) equal run's text, streamed chunks join to the whole text, reusing the KV of
a shared prefix changes nothing, and clients asking at once each get what they get alone."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from serve_helpers import FAST, Server, tiny_pair
from tforce.cli import app
from tforce.model.synthetic import byte_tokenizer

DOC = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness."
QUESTIONS = ["Who wrote it?", "When was it?", "What age was it?", "Was it the best?"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("serve-exact"), template=True)


@pytest.fixture(scope="module")
def server(pair):
    target, draft = pair
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "16")
    yield s
    assert s.stop() == 0


def _run(pair, prompt: str, *args: str) -> str:
    target, draft = pair
    r = CliRunner().invoke(app, ["run", "-m", str(target), "--draft", str(draft), *FAST, "-n", "16", "-p", prompt,
                                 "--json", *args], input="")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["text"]


def _complete(server, prompt: str, **kw) -> str:
    r = server.post("/completions", {"model": server.model(), "prompt": prompt, "max_tokens": 16,
                                     "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_completion_equals_run(server, pair):
    client = server.client()
    prompt = DOC + "\n\n" + QUESTIONS[0]
    got = client.completions.create(model=server.model(), prompt=prompt, max_tokens=16, temperature=0)
    want = _run(pair, prompt, "--template", "none")  # completions take the text as it is
    assert got.choices[0].text == want and want
    assert got.usage.completion_tokens >= 1 and got.usage.prompt_tokens == len(byte_tokenizer().encode(prompt))
    assert got.choices[0].finish_reason in ("stop", "length")


def test_chat_equals_run_with_the_template(server, pair):
    client = server.client()
    got = client.chat.completions.create(model=server.model(), temperature=0, max_tokens=16,
                                         messages=[{"role": "user", "content": DOC + "\n\n" + QUESTIONS[1]}])
    want = _run(pair, DOC + "\n\n" + QUESTIONS[1])  # run lays the prompt out in the template
    assert got.choices[0].message.content == want and want
    assert got.choices[0].message.role == "assistant"
    assert want != _run(pair, DOC + "\n\n" + QUESTIONS[1], "--template", "none")  # the template mattered


def test_streamed_chunks_join_to_the_whole_text(server):
    client = server.client()
    for chat in (False, True):
        body = dict(model=server.model(), max_tokens=16, temperature=0)
        if chat:
            whole = client.chat.completions.create(messages=[{"role": "user", "content": QUESTIONS[2]}], **body)
            chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": QUESTIONS[2]}],
                                                         stream=True, **body))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == whole.choices[0].message.content
        else:
            whole = client.completions.create(prompt=QUESTIONS[2], **body)
            chunks = list(client.completions.create(prompt=QUESTIONS[2], stream=True, **body))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text == whole.choices[0].text
        assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stream_ends_with_done_and_usage(server):
    events = server.events("/completions", {"prompt": QUESTIONS[0], "max_tokens": 8, "temperature": 0,
                                            "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] >= 1
    assert events[-3]["choices"][0]["finish_reason"] in ("stop", "length") and "tforce" in events[-3]


def test_prefix_reuse_changes_nothing(server):
    """Each question after the same document, asked alone first (the document prefilled from scratch each
    time: another document in between), then one after another (the document's KV reused)."""
    alone = []
    for q in QUESTIONS:
        _complete(server, "A different document entirely, to push the first one out.")
        alone.append(_complete(server, DOC + "\n\n" + q))
    reused = []
    for q in QUESTIONS + QUESTIONS[:1]:
        r = server.post("/completions", {"prompt": DOC + "\n\n" + q, "max_tokens": 16, "temperature": 0})
        reused.append((r.json()["choices"][0]["text"], r.json()["tforce"]))
    assert [text for text, _ in reused] == alone + alone[:1]
    doc_tokens = len(byte_tokenizer().encode(DOC + "\n\n"))
    assert all(ext["prefix_reused"] >= doc_tokens for _, ext in reused[1:])
    assert all(ext["prefilled_tokens"] < 20 for _, ext in reused[1:])


def test_clients_at_once_get_what_they_get_alone(server):
    prompts = [DOC + "\n\n" + q for q in QUESTIONS]
    alone = [_complete(server, p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: _complete(server, p), prompts))
    assert together == alone


def test_kv_dir_serves_a_document_after_a_restart(pair, tmp_path):
    """A long prompt's KV is kept in --kv-dir; a new server's question about the same document loads it
    (prefilling only the question) and answers as a server that prefilled it all."""
    target, draft = pair
    opts = ["-m", str(target), "--draft", str(draft), *FAST, "-n", "16", "--kv-dir", str(tmp_path / "kv"),
            "--kv-dir-min", "64"]
    doc = (DOC + " ") * 3
    first = Server(*opts)
    try:
        _complete(first, doc + "\n\n" + QUESTIONS[0])
        first.wait_line("--kv-dir: ")
    finally:
        assert first.stop() == 0
    assert len(list((tmp_path / "kv").iterdir())) == 1
    second = Server(*opts)
    try:
        r = second.post("/completions", {"prompt": doc + "\n\n" + QUESTIONS[1], "max_tokens": 16, "temperature": 0})
        stats = r.json()["tforce"]
        assert stats["prefix_from_kv_dir"] >= len(byte_tokenizer().encode(doc + "\n\n"))
        assert stats["prefilled_tokens"] < 20
    finally:
        assert second.stop() == 0
    assert r.json()["choices"][0]["text"] == _run(pair, doc + "\n\n" + QUESTIONS[1], "--template", "none")


def test_kv_dir_keeps_under_its_size_the_most_recent(pair, tmp_path):
    target, draft = pair
    server = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "4", "--kv-dir", str(tmp_path / "kv"),
                    "--kv-dir-min", "64", "--kv-dir-size", "1")
    try:
        for doc in ("First document. " * 8, "Second document. " * 8):
            _complete(server, doc, max_tokens=4)
        assert sum("--kv-dir: " in line and "saved" in line for line in server.lines) == 2
    finally:
        assert server.stop() == 0
    [kept] = (tmp_path / "kv").iterdir()
    tokens = json.loads((kept / "manifest.json").read_text())["tokens"]
    assert byte_tokenizer().decode(tokens).startswith("Second document.")


def test_seeded_sample_is_runs_whatever_the_cache_held(server, pair):
    """temperature > 0 with a seed: the draw `tforce run --seed` makes, whether the document's KV was
    prefilled for it, kept from an earlier question or reused after another document."""
    prompt = DOC + "\n\n" + QUESTIONS[3]
    # the method the server runs (it plans without calibration: ar on the CPU); run's default, auto, times
    # the methods and may choose another under load, whose draws differ (the same distribution)
    want = _run(pair, prompt, "--template", "none", "--temperature", "0.9", "--seed", "7", "--method", "ar")
    got = []
    for before in ("Another document.", DOC + "\n\n" + QUESTIONS[0], prompt):
        _complete(server, before)
        got.append(_complete(server, prompt, temperature=0.9, seed=7))
    assert got == [want] * 3
    assert _complete(server, prompt, temperature=0.9, seed=8) != want  # the seed mattered
