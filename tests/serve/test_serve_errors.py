"""Bad requests to `tforce serve` each get their 4xx and an error object in OpenAI's shape, the server
keeps answering after each; a model without a chat template refuses chat naming /v1/completions; a
missing web stack is one line naming the install."""
from __future__ import annotations

import importlib.util

import httpx
import pytest
from typer.testing import CliRunner

from serve_helpers import FAST, Server, tiny_pair
from tforce.cli import app

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, draft = tiny_pair(tmp_path_factory.mktemp("serve-errors"))  # no chat template
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "4", "--api-key", KEY, "--max-body", "4096",
               "--ctx-size", "256")
    s.http.headers["Authorization"] = f"Bearer {KEY}"
    yield s
    assert s.stop() == 0


def _refused(r, status: int, needle: str, code=None) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert needle in error["message"], error
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if code is not None:
        assert error["code"] == code
    assert "Traceback" not in r.text


def _still_answers(server) -> None:
    r = server.post("/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


BAD = [  # (body, status, what the message says, code)
    ({"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens must be >= 0", None),
    ({"prompt": "Hi", "model": "gpt-4"}, 404, "'gpt-4' is not served here", "model_not_found"),
    ({"prompt": "x" * 300}, 400, "the server's context is 256", "context_length_exceeded"),
    ({"prompt": "Hi", "n": 2}, 400, "n=2 is not supported", None),
    ({"prompt": "Hi", "temperature": "hot"}, 400, "temperature must be a number", None),
    ({"prompt": "Hi", "top_p": 0}, 400, "top_p must be in (0, 1]", None),
    ({"prompt": "Hi", "stop": ["a", ""]}, 400, "stop strings must not be empty", None),
    ({"prompt": ["Hi", "x" * 300]}, 400, "prompt[1] is 300 tokens; the server's context is 256",
     "context_length_exceeded"),
    ({"max_tokens": 2}, 400, "prompt must be a string", None),
    ({"prompt": "Hi", "stream": "yes"}, 400, "stream must be true or false", None),
]


@pytest.mark.parametrize("body,status,needle,code", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_request_gets_its_4xx(server, body, status, needle, code):
    _refused(server.post("/completions", body), status, needle, code)
    _still_answers(server)


def test_malformed_json(server):
    r = server.http.post("/completions", content=b'{"prompt": "Hi",', headers={"Content-Type": "application/json"})
    _refused(r, 400, "not valid JSON")
    _still_answers(server)


def test_oversized_body(server):
    _refused(server.post("/completions", {"prompt": "x" * 5000}), 413, "larger than the server's limit",
             "request_too_large")

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(10):
            yield b"x" * 1000

    _refused(server.http.post("/completions", content=chunks()), 413, "larger than the server's limit")
    _still_answers(server)


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = server.http.post("/completions", json={"prompt": "Hi"}, headers={"Authorization": ""} | headers)
        _refused(r, 401, "a valid API key is needed", "invalid_api_key")
    r = server.http.get("/models", headers={"Authorization": "Bearer wrong"})
    _refused(r, 401, "API key")
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        server.client("wrong").completions.create(model=server.model(), prompt="Hi", max_tokens=1)
    assert server.client(KEY).completions.create(model=server.model(), prompt="Hi", max_tokens=1).choices
    health = httpx.get(server.url.removesuffix("/v1") + "/health")  # a supervisor's check needs no key
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    _still_answers(server)


def test_chat_without_a_template_names_completions(server):
    r = server.post("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    _refused(r, 400, "/v1/completions", "no_chat_template")
    r = server.post("/chat/completions", {"messages": []})
    _refused(r, 400, "messages must be a non-empty list")


def test_unknown_route_and_method(server):
    _refused(server.http.get("/nothing-here"), 404, "Not Found", "not_found")
    _refused(server.http.get("/completions"), 405, "Method Not Allowed")
    _still_answers(server)


def test_every_refusal_is_one_stderr_line(server):
    before = len(server.lines)
    server.post("/completions", {"prompt": "Hi", "max_tokens": -5})
    line = server.wait_line("max_tokens must be >= 0, got -5")
    assert line.startswith("tforce: serve: POST /v1/completions: 400 ")
    assert not any("Traceback" in l for l in server.lines[before:])


def test_missing_web_stack_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    r = CliRunner().invoke(app, ["serve"])
    assert r.exit_code == 1
    assert r.stderr.strip() == "tforce: error: tforce serve needs uvicorn: pip install 'tforce[serve]'"
