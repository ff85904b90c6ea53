"""`tforce serve --max-batch N`: requests arriving while others are answered join the running batch
(serve/batch.py) and each answer is what the request gets alone (greedy, float32 on the CPU): as `tforce
run` prints it and as a server without batching answers it, streamed or not; requests that cannot be rows
(log-probabilities) still run, alone; seeded samples are rows and draw what they draw alone; a client that goes away leaves the others' answers
unchanged; a bad --max-batch is one line."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from serve_helpers import FAST, Server, tiny_pair
from tforce.cli import app

DOC = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness."
QUESTIONS = ["Who wrote it?", "When was it?", "What age was it?", "Was it the best?", "Was it the worst?",
             "Which age?", "Wisdom or foolishness?", "Best or worst?"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("serve-batch"))


@pytest.fixture(scope="module", params=["triforce", "naive"])
def server(request, pair):
    target, draft = pair
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "24", "--method", request.param,
               "--max-batch", "3")
    s.method = request.param
    yield s
    assert s.stop() == 0


def _run(pair, prompt: str, method: str, n: int, *more: str) -> str:
    target, draft = pair
    r = CliRunner().invoke(app, ["run", "-m", str(target), "--draft", str(draft), *FAST, "-n", str(n), "-p", prompt,
                                 "--method", method, "--template", "none", "--json", *more], input="")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["text"]


def _complete(server, prompt: str, **kw) -> dict:
    r = server.post("/completions", {"model": server.model(), "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                     **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_clients_at_once_join_the_batch_and_get_what_they_get_alone(server, pair):
    """Eight clients, three rows: the later requests join as rows finish; budgets differ, so rows leave at
    different rounds and others take their places."""
    prompts = [DOC + "\n\n" + q for q in QUESTIONS]
    budgets = [24, 5, 17, 24, 1, 9, 24, 12]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda a: _complete(server, a[0], max_tokens=a[1]), zip(prompts, budgets)))
    for prompt, n, answer in zip(prompts, budgets, got):
        assert answer["choices"][0]["text"] == _run(pair, prompt, server.method, n)
        assert answer["tforce"]["batched"] is True and answer["usage"]["completion_tokens"] <= n
    # a request joining while another row holds the document copies its K/V instead of prefilling it
    assert any(a["tforce"]["prefix_reused"] >= len(DOC) for a in got)


def test_a_streamed_row_joins_to_the_whole_text_while_others_run(server):
    body = {"model": server.model(), "prompt": DOC + "\n\n" + QUESTIONS[2], "max_tokens": 24, "temperature": 0}
    whole = _complete(server, body["prompt"])["choices"][0]["text"]
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(_complete, server, DOC + "\n\n" + q) for q in QUESTIONS[:2]]
        events = server.events("/completions", dict(body, stream=True))
        [f.result() for f in others]
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")) == whole


def test_requests_with_log_probabilities_run_alone_beside_the_batch(server):
    """Log-probabilities: not rows (serve/batch.py), answered alone, as before."""
    prompt = DOC + "\n\n" + QUESTIONS[3]
    with ThreadPoolExecutor(4) as pool:
        rows = [pool.submit(_complete, server, DOC + "\n\n" + q) for q in QUESTIONS[4:7]]
        logprobs = pool.submit(_complete, server, prompt, logprobs=2)
        assert all(r.result()["tforce"]["batched"] for r in rows)
        lp = logprobs.result()
        assert "batched" not in lp["tforce"] and len(lp["choices"][0]["logprobs"]["tokens"]) >= 1


def test_seeded_samples_are_rows_and_draw_what_they_draw_alone(server, pair):
    """Sampled with a seed, batched beside others (each row its own generator): the text `tforce run` prints
    with that seed."""
    prompts = [DOC + "\n\n" + q for q in QUESTIONS[:3]]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda a: _complete(server, a[1], temperature=0.8, seed=a[0]), enumerate(prompts)))
    for seed, (prompt, answer) in enumerate(zip(prompts, got)):
        assert answer["tforce"]["batched"] is True
        assert answer["choices"][0]["text"] == _run(pair, prompt, server.method, 24, "--temperature", "0.8",
                                                     "--seed", str(seed))


def test_sampled_rows_without_a_seed_are_batched(server):
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda q: _complete(server, DOC + "\n\n" + q, temperature=0.9), QUESTIONS[:3]))
    assert all(g["tforce"]["batched"] and g["usage"]["completion_tokens"] >= 1 for g in got)


def test_a_client_that_leaves_does_not_change_the_others(server):
    prompts = [DOC + "\n\n" + q for q in QUESTIONS[5:8]]
    alone = [_complete(server, p)["choices"][0]["text"] for p in prompts]
    with ThreadPoolExecutor(3) as pool:
        together = [pool.submit(_complete, server, p) for p in prompts]
        with server.http.stream("POST", "/completions", json={"model": server.model(), "prompt": DOC, "stream": True,
                                                              "max_tokens": 24, "temperature": 0}) as r:
            next(r.iter_lines())  # one chunk, then the client goes away
        assert [f.result()["choices"][0]["text"] for f in together] == alone
    time.sleep(0.5)
    assert _complete(server, prompts[0])["choices"][0]["text"] == alone[0]  # the server goes on


@pytest.mark.parametrize("args, line", [
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["--max-batch", "-2"], "--max-batch must be >= 1, got -2"),
    (["--max-batch", "2", "--deterministic"], "--max-batch above 1 and --deterministic are not supported together yet")])
def test_a_bad_max_batch_is_one_line(pair, args, line):
    target, draft = pair
    r = CliRunner().invoke(app, ["serve", "-m", str(target), "--draft", str(draft), *args])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [f"tforce: error: {line}"]
