"""A real `tforce serve` process on 127.0.0.1 for the server's tests: started on a port the system picks,
its stderr lines collected, stopped with SIGTERM."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
FRESH = httpx.Limits(max_keepalive_connections=0)  # a new connection for each request (Server.http)
DEMO = ROOT / "models"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


class Server:
    def __init__(self, *args: str, startup_s: float = 120):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TFORCE_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "tforce", "serve", "--port", "0", "--threads", "1",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=ROOT)
        self.lines: list[str] = []
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                found = re.search(r"on (http://\S+/v1)", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(startup_s)
        if self.url is None:
            self.proc.kill()
            raise AssertionError("the server did not start:\n" + "\n".join(self.lines))
        # No connection kept between requests: the server closes an idle one after uvicorn's 5 s keep-alive,
        # and a request sent on it just then is answered by a closed socket (a test's pause can be 5 s).
        self.http = httpx.Client(base_url=self.url, timeout=120, limits=FRESH)

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def model(self) -> str:
        """The model's id, as /v1/models lists it."""
        return self.http.get("/models").json()["data"][0]["id"]

    def client(self, api_key: str = "none"):
        from openai import OpenAI

        return OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=120,
                      http_client=httpx.Client(limits=FRESH, timeout=120))

    def events(self, path: str, body: dict) -> list:
        """The stream's events, parsed (the last is "[DONE]")."""
        out = []
        with self.http.stream("POST", path, json=dict(body, stream=True)) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    out.append(data if data == "[DONE]" else json.loads(data))
        return out

    def wait_line(self, needle: str, timeout: float = 30) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = next((line for line in self.lines if needle in line), None)
            if hit:
                return hit
            time.sleep(0.05)
        raise AssertionError(f"no stderr line with {needle!r}:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def tiny_pair(root: Path, template: bool = False, context: int = 512) -> tuple[Path, Path]:
    """A tiny random target and draft with the byte tokenizer; with template, the target's tokenizer has a
    chat template that writes no special tokens."""
    from tforce.model.synthetic import byte_tokenizer, make_checkpoint

    target = make_checkpoint(root / "target", seed=0, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context)
    draft = make_checkpoint(root / "draft", seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context)
    if template:
        tok = byte_tokenizer()
        tok.chat_template = TEMPLATE
        tok.save_pretrained(target)
    return target, draft


FAST = ["--budget", "64", "--draft-budget", "32", "--sinks", "4", "--temperature", "0"]


def target_logprobs(target: Path, seq: list, start: int):
    """The target alone: the log-softmax of its logits at the positions before seq[start:] (one plain forward
    over seq), row k for the token seq[start + k]."""
    import torch

    import tforce
    from tforce.cache import FullCache
    from tforce.cache.rope import Rotary

    m = tforce.load_model(str(target), tokenizer=False).model
    cache = FullCache(m.config.num_hidden_layers, m.n_kv_heads, m.head_dim, len(seq), Rotary(m.config, len(seq)))
    cache.begin(len(seq))
    return torch.log_softmax(m(torch.tensor([seq]), cache)[0].float(), -1)[start - 1:len(seq) - 1]
