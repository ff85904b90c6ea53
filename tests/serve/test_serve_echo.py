"""`echo: true` on /v1/completions, as lm-evaluation-harness's loglikelihood requests send it (`echo: true,
logprobs: N, max_tokens: 1` or 0): the text starts with the prompt, and the log-probabilities cover the
prompt's tokens, each the target's own log-softmax at the position before it (one plain forward of the
target over the prompt), also when the server reuses the prompt's KV from an earlier request; the first
prompt token has none. Without logprobs, the prompt's text is prepended. Streamed, the prompt is the first
chunk. Refused on chat."""
from __future__ import annotations

import pytest

from serve_helpers import FAST, Server, target_logprobs, tiny_pair
from tforce.model.synthetic import byte_tokenizer

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom"
TOP = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target, draft = tiny_pair(tmp_path_factory.mktemp("serve-echo"), template=True)
    # chunks of 16: the prompt's forward takes several
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "8", "--ctx-size", "256", "--ignore-eos",
               "--prefill-chunk", "16")
    yield s, target
    assert s.stop() == 0


def _echo(server, prompt, max_tokens: int, **kw) -> dict:
    r = server.post("/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "echo": True,
                                     "logprobs": TOP, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _check_against_the_target(target, ids: list, choice: dict, new: list) -> None:
    """choice's logprobs cover ids + new, each token's value and alternatives the target's own."""
    tok = byte_tokenizer()
    lp = choice["logprobs"]
    seq = ids + new
    assert lp["tokens"] == [tok.decode([t]) for t in seq]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes the first
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:k]) for k in range(len(seq))]
    ref = target_logprobs(target, seq, 1)  # row k: the distribution of seq[k + 1]
    for k in range(1, len(seq)):
        assert abs(lp["token_logprobs"][k] - float(ref[k - 1, seq[k]])) < 1e-4, k
        best = ref[k - 1].topk(TOP).values.tolist()
        alts = list(lp["top_logprobs"][k].values())  # keyed by text: two ids may share one
        assert max(alts) == pytest.approx(best[0], abs=1e-4)
        assert all(any(abs(v - b) < 1e-4 for b in best) for v in alts), k


def _greedy(target, ids: list, max_tokens: int) -> list:
    """The target's greedy answer of 0 or 1 token (its position's logits do not depend on the token after)."""
    return [int(target_logprobs(target, ids + [0], len(ids))[0].argmax())] if max_tokens else []


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "ids"])
def test_echoed_prompt_logprobs_are_the_targets(served, as_ids, max_tokens):
    server, target = served
    tok = byte_tokenizer()
    ids = tok(TEXT).input_ids
    out = _echo(server, [ids] if as_ids else TEXT, max_tokens)
    choice = out["choices"][0]
    answer = server.post("/completions", {"prompt": TEXT, "max_tokens": max_tokens,
                                          "temperature": 0}).json()["choices"][0]["text"]
    assert choice["text"] == TEXT + answer  # token ids echo as their text, without the BOS
    new = _greedy(target, ids, max_tokens)
    assert answer == tok.decode(new)
    assert len(new) == max_tokens == out["usage"]["completion_tokens"] and out["usage"]["prompt_tokens"] == len(ids)
    _check_against_the_target(target, ids, choice, new)


def test_a_reused_prefix_still_has_its_logprobs(served):
    """A second identical request finds the prompt's KV held (prefilling only its last token): its prompt
    log-probabilities are still every position's."""
    server, target = served
    ids = byte_tokenizer()(TEXT + " again").input_ids
    first = _echo(server, [ids], 1)
    second = _echo(server, [ids], 1)
    assert second["tforce"]["prefix_reused"] == len(ids) - 1
    # the prompt's part, from a plain forward, is the same to the bit; the answer's token is the decoding's own
    n = len(ids)
    assert second["choices"][0]["logprobs"]["token_logprobs"][:n] == first["choices"][0]["logprobs"]["token_logprobs"][:n]
    _check_against_the_target(target, ids, second["choices"][0], _greedy(target, ids, 1))


def test_several_prompts_as_lm_evaluation_harness_sends_them(served):
    server, target = served
    tok = byte_tokenizer()
    contexts = [tok(TEXT).input_ids, tok("Call me Ishmael.").input_ids]
    out = _echo(server, contexts, 1, logprobs=1)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for ids, choice in zip(contexts, out["choices"]):
        alone = _echo(server, [ids], 1, logprobs=1)["choices"][0]
        assert choice["text"] == alone["text"] and choice["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-5)
        _check_against_the_target(target, ids, choice, _greedy(target, ids, 1))


def test_echo_without_logprobs_prepends_the_prompt(served):
    server, _ = served
    plain = server.post("/completions", {"prompt": TEXT, "max_tokens": 4, "temperature": 0}).json()
    r = server.post("/completions", {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == TEXT + plain["choices"][0]["text"]
    assert r.json()["choices"][0]["logprobs"] is None
    tok = byte_tokenizer()  # token ids that start with the BOS echo as their text, without it
    ids = [tok.bos_token_id] + tok(TEXT, add_special_tokens=False).input_ids
    plain = server.post("/completions", {"prompt": [ids], "max_tokens": 4, "temperature": 0}).json()
    r = server.post("/completions", {"prompt": [ids], "max_tokens": 4, "temperature": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == TEXT + plain["choices"][0]["text"]


def test_echo_streams_the_prompt_first(served):
    server, target = served
    ids = byte_tokenizer()(TEXT).input_ids
    whole = _echo(server, TEXT, 4)["choices"][0]
    events = server.events("/completions", {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "echo": True,
                                            "logprobs": TOP})
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert chunks[0]["text"] == TEXT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert len(chunks[0]["logprobs"]["tokens"]) == len(ids)  # the prompt's tokens, with the prompt's text
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    want = whole["logprobs"]["token_logprobs"]
    assert joined[:len(ids)] == want[:len(ids)]  # the prompt's, from the same plain forward
    assert joined[len(ids):] == pytest.approx(want[len(ids):], abs=1e-5) and len(joined) == len(ids) + 4
    plain = server.events("/completions", {"prompt": TEXT, "max_tokens": 2, "temperature": 0, "echo": True})
    assert plain[0]["choices"][0]["text"] == TEXT and plain[0]["choices"][0]["logprobs"] is None


def test_echo_on_chat_is_refused(served):
    server, _ = served
    r = server.post("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text


def test_a_one_token_prompt_echoes_one_null(served):
    server, _ = served
    lp = _echo(server, [byte_tokenizer()("H", add_special_tokens=False).input_ids], 0)["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H"] and lp["token_logprobs"] == [None] and lp["top_logprobs"] == [None]
