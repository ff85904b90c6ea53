"""Several prompts in one /v1/completions request (a list of strings, or a list of token-id lists): a choice
per prompt, indexed in order, each what that prompt gets alone (greedy, and sampled with the same seed),
usage summed over them, one request in /metrics; streamed, each choice's chunks after the last's, with its
index."""
from __future__ import annotations

import pytest

from serve_helpers import FAST, Server, tiny_pair
from tforce.model.synthetic import byte_tokenizer

PROMPTS = ["It was the best of times", "Call me Ishmael.", "It was the best of times, it was"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, draft = tiny_pair(tmp_path_factory.mktemp("serve-prompts"))
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "10", "--ctx-size", "256", "--ignore-eos")
    yield s
    assert s.stop() == 0


def _post(server, prompt, **kw) -> dict:
    r = server.post("/completions", {"prompt": prompt, "max_tokens": 10, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.2, "seed": 7}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "ids"])
def test_each_choice_is_its_prompt_alone(server, sampling, as_ids):
    tok = byte_tokenizer()
    prompts = [tok(p).input_ids for p in PROMPTS] if as_ids else PROMPTS
    alone = [_post(server, p, **sampling) for p in prompts]
    both = _post(server, prompts, **sampling)
    assert [c["index"] for c in both["choices"]] == list(range(len(PROMPTS)))
    assert [c["text"] for c in both["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert [c["finish_reason"] for c in both["choices"]] == ["length"] * len(PROMPTS)
    assert len({c["text"] for c in both["choices"]}) == len(PROMPTS)  # different answers: the order is checked
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert both["usage"][key] == sum(a["usage"][key] for a in alone)
    assert both["usage"]["prompt_tokens"] == sum(len(tok(p).input_ids) for p in PROMPTS)
    # each prompt's statistics, in order
    assert [s["prefix_reused"] + s["prefilled_tokens"] for s in both["tforce"]] == [len(tok(p).input_ids)
                                                                                   for p in PROMPTS]


def test_one_prompt_in_a_list_is_one_choice(server):
    out = _post(server, [PROMPTS[0]], temperature=0)
    assert len(out["choices"]) == 1 and isinstance(out["tforce"], dict)
    assert out["choices"][0]["text"] == _post(server, PROMPTS[0], temperature=0)["choices"][0]["text"]


def test_several_prompts_count_as_one_request(server):
    root = server.url.removesuffix("/v1")

    def value(name: str) -> float:
        page = server.http.get(root + "/metrics").text
        return float(next((x for x in page.splitlines() if x.startswith(name + " ")), f"{name} 0").split()[-1])

    ok, tokens = value('tforce_requests_total{status="200"}'), value("tforce_generation_tokens_total")
    out = _post(server, PROMPTS, temperature=0)
    assert value('tforce_requests_total{status="200"}') == ok + 1
    assert value("tforce_generation_tokens_total") == tokens + out["usage"]["completion_tokens"] == tokens + 30


def test_several_prompts_stream_one_choice_after_another(server):
    whole = _post(server, PROMPTS, temperature=0, logprobs=1)
    events = server.events("/completions", {"prompt": PROMPTS, "max_tokens": 10, "temperature": 0, "logprobs": 1,
                                            "stream_options": {"include_usage": True}})
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    order = [c["index"] for c in chunks]
    assert order == sorted(order) and set(order) == {0, 1, 2}  # one choice after another
    for i, want in enumerate(whole["choices"]):
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["text"] for c in mine) == want["text"]
        assert [c["finish_reason"] for c in mine][-1] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == want["logprobs"]["tokens"]
    assert events[-2]["usage"] == whole["usage"]
