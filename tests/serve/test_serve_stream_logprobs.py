"""Log-probabilities with stream: true: each chunk carries those of the tokens it carries (completions:
choices[0].logprobs with the four lists; chat: choices[0].logprobs.content), and joined they are what the
same greedy request answers whole."""
from __future__ import annotations

import pytest

from serve_helpers import FAST, Server, tiny_pair
from tforce.model.synthetic import byte_tokenizer

TEXT = "It was the best of times, it was the worst of times"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, draft = tiny_pair(tmp_path_factory.mktemp("serve-stream-logprobs"), template=True)
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "--ctx-size", "256", "--ignore-eos")
    yield s, target
    assert s.stop() == 0


def _chunks(server, path: str, body: dict) -> list:
    events = server.events(path, body)
    assert events[-1] == "[DONE]"
    return [e["choices"][0] for e in events[:-1] if e["choices"]]


def _same_values(got: list, want: list) -> None:
    """Log-probabilities of one answer, streamed and whole: the whole request reuses the prompt's KV, so its
    values may differ in the last bits."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None) and (g is None or abs(g - w) < 1e-5), (g, w)


def _greedy(target, max_tokens: int) -> list:
    """The target's greedy tokens after TEXT (any method's, as every method is exact)."""
    import tforce

    ids = byte_tokenizer()(TEXT).input_ids
    return tforce.generate(tforce.load_model(str(target)), ids, method="ar", temperature=0, ignore_eos=True,
                           max_new_tokens=max_tokens).tokens


@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop-string"])
def test_completion_chunks_carry_their_tokens_logprobs(server, stop):
    server, target = server
    body = {"prompt": TEXT, "max_tokens": 24, "temperature": 0, "logprobs": 2}
    new = _greedy(target, 24)
    if stop:  # a string the answer holds, after some tokens: the text ends before it, held back meanwhile
        shown = byte_tokenizer().decode(new)
        body["stop"] = next(shown[i:i + 2] for i in range(6, len(shown)) if "\ufffd" not in shown[i:i + 2])
    r = server.post("/completions", body)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]
    assert whole["finish_reason"] == ("stop" if stop else "length")
    chunks = _chunks(server, "/completions", body)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    parts = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    assert len(parts) > 1  # streamed as the tokens come, not all on the last chunk
    joined = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    lp = whole["logprobs"]
    assert joined["tokens"] == lp["tokens"] and len(lp["tokens"]) == r.json()["usage"]["completion_tokens"]
    assert joined["text_offset"] == lp["text_offset"]
    _same_values(joined["token_logprobs"], lp["token_logprobs"])
    assert [list(d) for d in joined["top_logprobs"]] == [list(d) for d in lp["top_logprobs"]]
    _same_values([v for d in joined["top_logprobs"] for v in d.values()],
                 [v for d in lp["top_logprobs"] for v in d.values()])
    # each chunk carries the tokens whose text the text so far completes, and no later one
    tok, text, k = byte_tokenizer(), "", 0
    for c in chunks[:-1]:  # the last carries what is left (cut by the stop string)
        text += c["text"]
        k += len(c["logprobs"]["tokens"]) if c["logprobs"] else 0
        assert text.startswith(tok.decode(new[:k])), (k, text)
        assert k == len(new) or not text.startswith(tok.decode(new[:k + 1])), (k, text)


def test_chat_chunks_carry_their_tokens_logprobs(server):
    server, _ = server
    body = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 16, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    r = server.post("/chat/completions", body)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]["logprobs"]["content"]
    chunks = _chunks(server, "/chat/completions", body)
    got = [x for c in chunks if c["logprobs"] is not None for x in c["logprobs"]["content"]]
    assert len(got) == len(want) == 16
    assert [(x["token"], x["bytes"]) for x in got] == [(x["token"], x["bytes"]) for x in want]
    _same_values([x["logprob"] for x in got], [x["logprob"] for x in want])
    assert [[a["token"] for a in x["top_logprobs"]] for x in got] == [[a["token"] for a in x["top_logprobs"]]
                                                                       for x in want]


def test_stream_without_logprobs_carries_none(server):
    server, _ = server
    chunks = _chunks(server, "/completions", {"prompt": TEXT, "max_tokens": 4, "temperature": 0})
    assert all(c["logprobs"] is None for c in chunks)
