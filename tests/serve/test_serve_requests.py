"""Requests as real clients send them: no-op values accepted, what would change the answer and is not
implemented refused naming its field (never ignored), stop lists of any length, a prompt as token ids (the
same answer as its text), top_k applied, content null, GET /v1/models/{id}, /v1/health, and the model's
id the folder's name, not the path typed."""
from __future__ import annotations

import json

import pytest

from serve_helpers import FAST, Server, target_logprobs, tiny_pair
from tforce.serve.requests import ApiError, parse

NO_OPS = {"response_format": {"type": "text"}, "logit_bias": {}, "top_logprobs": 0, "tool_choice": "none",
          "functions": [], "tools": [], "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
          "min_p": 0, "n": 1, "best_of": 1, "logprobs": False, "echo": False, "suffix": ""}
REFUSED = [("presence_penalty", 1.5), ("frequency_penalty", -0.5), ("repetition_penalty", 1.2), ("min_p", 0.05),
           ("logit_bias", {"5": 10}), ("response_format", {"type": "json_object"}),
           ("tool_choice", "auto")]


def _parse(body: dict, chat: bool = False):
    return parse(json.dumps(body).encode(), chat)


def test_no_op_values_are_accepted():
    ask = _parse({"prompt": "hi", **NO_OPS})
    assert ask.prompts == ("hi",) and ask.top_k is None


@pytest.mark.parametrize("key,value", REFUSED, ids=[k for k, _ in REFUSED])
def test_what_would_change_the_answer_is_refused_naming_it(key, value):
    with pytest.raises(ApiError) as e:
        _parse({"prompt": "hi", key: value})
    assert e.value.status == 400 and e.value.param == key and key in e.value.message


def test_prompt_forms_stops_top_k_and_null_content():
    assert _parse({"prompt": [5, 6, 7]}).prompts == ((5, 6, 7),)
    assert _parse({"prompt": [[5, 6, 7]]}).prompts == ((5, 6, 7),)  # lm-evaluation-harness's form
    assert _parse({"prompt": ["text"]}).prompts == ("text",)
    assert _parse({"prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))  # several prompts
    assert _parse({"prompt": ["a", "b"]}).prompts == ("a", "b")
    for bad in ([1, "a"], [True, 2], [[1], []], ["a", ""], [], [[1.5]], 5):
        with pytest.raises(ApiError) as e:
            _parse({"prompt": bad})
        assert e.value.status == 400 and e.value.param == "prompt", bad
    assert len(_parse({"prompt": "x", "stop": [f"s{i}" for i in range(7)]}).stop) == 7  # continue.dev sends 7
    assert _parse({"prompt": "x", "top_k": -1}).top_k == 0 and _parse({"prompt": "x", "top_k": 40}).top_k == 40
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "user", "content": "again"}]
    assert _parse({"messages": msgs}, chat=True).messages[1] == {"role": "assistant", "content": ""}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target, draft = tiny_pair(tmp_path_factory.mktemp("serve-requests"))
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "12", "--ctx-size", "256")
    yield s, target
    assert s.stop() == 0


def test_token_ids_answer_as_their_text(served):
    from tforce.model.synthetic import byte_tokenizer

    server, _ = served
    text = "It was the best of times"
    ids = byte_tokenizer()(text, add_special_tokens=False).input_ids
    by_text = server.post("/completions", {"prompt": text, "max_tokens": 12, "temperature": 0})
    by_ids = server.post("/completions", {"prompt": [ids], "max_tokens": 12, "temperature": 0})
    assert by_text.status_code == by_ids.status_code == 200, (by_text.text, by_ids.text)
    assert by_ids.json()["choices"][0]["text"] == by_text.json()["choices"][0]["text"]
    assert by_ids.json()["usage"]["prompt_tokens"] == by_text.json()["usage"]["prompt_tokens"] == len(ids)
    r = server.post("/completions", {"prompt": [ids + [10**6]], "max_tokens": 2})
    assert r.status_code == 400 and "Traceback" not in r.text, r.text


def test_top_k_one_samples_the_greedy_answer(served):
    server, _ = served
    def answer(**kw):
        r = server.post("/completions", {"prompt": "Hello there", "max_tokens": 12, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = answer(temperature=0)
    assert {answer(temperature=1.5, top_k=1, seed=s) for s in (1, 2)} == {greedy}  # top_k 1 is greedy
    assert {answer(temperature=1.5, top_k=0, seed=s) for s in (1, 2)} != {greedy}  # without it: samples


def test_model_routes_and_its_name(served):
    server, target = served
    name = server.model()
    assert name == target.name  # the folder's name, not the path given to -m
    r = server.http.get(f"/models/{name}")
    assert r.status_code == 200 and r.json()["id"] == name
    r = server.http.get("/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert server.http.get(server.url.removesuffix("/v1") + "/v1/health").json() == {"status": "ok"}


def test_tokenize_detokenize_and_tokenizer_info(served):
    from tforce.model.synthetic import byte_tokenizer

    server, _ = served
    root = server.url.removesuffix("/v1")
    text = "It was the best of times"
    want = byte_tokenizer()(text).input_ids
    for body in ({"prompt": text}, {"content": text}):  # vLLM's field, llama-server's
        r = server.http.post(root + "/tokenize", json=body)
        assert r.status_code == 200 and r.json()["tokens"] == want and r.json()["count"] == len(want), r.text
    bare = server.http.post(root + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == byte_tokenizer()(text, add_special_tokens=False).input_ids
    assert server.http.post(root + "/tokenize", json={"prompt": text}).json()["max_model_len"] == 256
    r = server.http.post(root + "/detokenize", json={"tokens": bare})
    assert r.status_code == 200 and r.json()["prompt"] == r.json()["content"] == text
    for bad in ({"tokens": [10**6]}, {"tokens": "abc"}):
        r = server.http.post(root + "/detokenize", json=bad)
        assert r.status_code == 400 and "Traceback" not in r.text, r.text
    assert server.http.post(root + "/tokenize", json={"prompt": 5}).status_code == 400
    info = server.http.get(root + "/tokenizer_info").json()
    assert info["eos_token"] == byte_tokenizer().eos_token and info["model_max_length"] == 256


def test_metrics_count_what_was_served(served):
    server, _ = served
    root = server.url.removesuffix("/v1")
    before = server.http.get(root + "/metrics").text
    r = server.post("/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    server.post("/completions", {"prompt": "Hello", "max_tokens": -1})  # a 400
    text = server.http.get(root + "/metrics").text

    def value(page: str, name: str) -> float:
        line = next((x for x in page.splitlines() if x.startswith(name + " ")), f"{name} 0")
        return float(line.split()[-1])

    usage = r.json()["usage"]
    assert value(text, "tforce_generation_tokens_total") - value(before, "tforce_generation_tokens_total") \
        == usage["completion_tokens"]
    assert value(text, "tforce_prompt_tokens_total") - value(before, "tforce_prompt_tokens_total") \
        == usage["prompt_tokens"]
    assert value(text, 'tforce_requests_total{status="400"}') == value(before, 'tforce_requests_total{status="400"}') + 1
    assert value(text, "tforce_time_to_first_token_seconds_count") >= 1
    assert "# TYPE tforce_acceptance_rate summary" in text


def test_metrics_text_format():
    from tforce.serve.metrics import Metrics

    m = Metrics()
    m.done(10, 4, {"prefix_reused": 6, "prefilled_tokens": 4, "prefill_s": 0.5, "decode_s": 1.25, "ttft_s": 0.75,
                   "acceptance": {"draft": 0.5, "retrieval": None}})
    m.done(3, 2, {"acceptance": {"draft": 0.25}})
    m.status(404)
    lines = set(m.text().splitlines())
    for want in ('tforce_requests_total{status="200"} 2', 'tforce_requests_total{status="404"} 1',
                 "tforce_prompt_tokens_total 13", "tforce_generation_tokens_total 6",
                 "tforce_prefix_reused_tokens_total 6", "tforce_decode_seconds_total 1.25",
                 "tforce_time_to_first_token_seconds_sum 0.75", "tforce_time_to_first_token_seconds_count 1",
                 'tforce_acceptance_rate_sum{level="draft"} 0.75', 'tforce_acceptance_rate_count{level="draft"} 2'):
        assert want in lines, (want, sorted(lines))
    assert not any("retrieval" in x for x in lines)  # a level that drafted nothing counts nothing


def test_chat_template_file_and_cors(tmp_path_factory):
    target, draft = tiny_pair(tmp_path_factory.mktemp("serve-template"))  # a base model: no chat template
    template = target.parent / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "4", "--ctx-size", "256",
               "--chat-template", str(template), "--allowed-origins", "http://localhost:3000")
    try:
        chat = s.post("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0})
        assert chat.status_code == 200, chat.text
        laid_out = s.http.post(s.url.removesuffix("/v1") + "/tokenize",
                               json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        from tforce.model.synthetic import byte_tokenizer

        assert laid_out == byte_tokenizer()("[user] Hi\n[assistant] ").input_ids
        # lm-evaluation-harness's remote tokenizer with --apply_chat_template: the messages as prompt
        as_prompt = s.http.post(s.url.removesuffix("/v1") + "/tokenize", json={
            "prompt": [{"role": "user", "content": "Hi"}], "add_special_tokens": False})
        assert as_prompt.status_code == 200 and as_prompt.json()["tokens"] == laid_out, as_prompt.text
        pre = s.http.options("/chat/completions", headers={"Origin": "http://localhost:3000",
                                                           "Access-Control-Request-Method": "POST"})
        assert pre.headers.get("access-control-allow-origin") == "http://localhost:3000"
        other = s.http.get("/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        assert s.stop() == 0


def test_bad_chat_template_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from tforce.cli import app

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    r = CliRunner().invoke(app, ["serve", "--chat-template", str(bad), "--port", "0"])
    assert r.exit_code == 2 and "--chat-template" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(app, ["serve", "--chat-template", str(tmp_path / "missing.jinja"), "--port", "0"])
    assert r.exit_code == 2 and "cannot read --chat-template" in r.output, r.output


@pytest.mark.parametrize("method,temperature", [("triforce", 0.0), ("triforce", 0.9), ("ar", 0.9)])
def test_logprobs_are_the_targets_own(tmp_path_factory, method, temperature):
    """Each generated token's log-probability (and its alternatives) is the target's log-softmax at its
    position, from the forward that decided it, whichever level proposed it and whatever the temperature."""
    from tforce.model.synthetic import byte_tokenizer

    target, draft = tiny_pair(tmp_path_factory.mktemp("serve-logprobs"), template=True)
    s = Server("-m", str(target), "--draft", str(draft), "--method", method, "--budget", "64", "--draft-budget",
               "32", "--sinks", "4", "--ctx-size", "256", "--ignore-eos")
    try:
        tok = byte_tokenizer()
        text = "It was the best of times, it was the worst of times"
        r = s.post("/completions", {"prompt": text, "max_tokens": 16, "temperature": temperature, "seed": 5,
                                    "logprobs": 3})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        ids = tok(text).input_ids
        import tforce  # the same draw in-process (a seeded request is tforce run --seed's draw)

        new = tforce.generate(tforce.load_model(str(target)), ids, draft=tforce.load_model(str(draft)), method=method,
                              max_new_tokens=16, temperature=temperature, seed=5, ignore_eos=True, budget=64,
                              draft_budget=32, sinks=4).tokens
        assert tok.decode(new) == r.json()["choices"][0]["text"]
        assert len(new) == len(lp["token_logprobs"]) == r.json()["usage"]["completion_tokens"] == 16
        ref = target_logprobs(target, ids + new, len(ids))
        for k, (t, got) in enumerate(zip(new, lp["token_logprobs"])):
            assert abs(got - float(ref[k, t])) < 1e-4, (k, got, float(ref[k, t]))
            best = ref[k].topk(3).values.tolist()  # completions' alternatives are a dict by text: two ids may share one
            alts = list(lp["top_logprobs"][k].values())
            assert max(alts) == pytest.approx(best[0], abs=1e-4)
            assert all(any(abs(v - b) < 1e-4 for b in best) for v in alts)
        # each token's own text: bytes of one character split over tokens decode apart to U+FFFD
        assert lp["tokens"] == [tok.decode([t]) for t in new]
        assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:k]) for k in range(len(new))]
        if temperature == 0:  # greedy: each token is its position's most likely
            assert all(max(d.values()) == pytest.approx(v, abs=1e-6) for d, v in zip(lp["top_logprobs"],
                                                                                     lp["token_logprobs"]))
        chat = s.post("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                            "temperature": 0, "logprobs": True, "top_logprobs": 2})
        content = chat.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
        plain = s.post("/completions", {"prompt": text, "max_tokens": 2})
        assert plain.json()["choices"][0]["logprobs"] is None  # off unless asked for
    finally:
        assert s.stop() == 0
