"""The command line through Typer's CliRunner: stdout carries only data, errors are one stderr line with
exit 2 (usage) or 1 (runtime), --json is exactly one object, greedy output equals plain decoding."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tforce
from tforce.cli import app
from tforce.model.synthetic import byte_tokenizer, make_checkpoint

from cli_helpers import DOC, DRAFT, FAST, TARGET, expected_tokens, one_error_line, run_pair, session_configs
from cli_helpers import models, runner  # noqa: F401 (fixtures)


def test_greedy_json_matches_plain_decoding(runner, models):
    r = run_pair(runner, models, str(models / "doc.txt"), *FAST, "--json", "--method", "triforce")
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert set(obj) == {"text", "tokens", "prompt_tokens", "method", "device", "chat_template", "stopped_by", "stats",
                        "auto", "cpu_threads"}
    assert obj["auto"] is None  # a method was named: nothing planned
    assert obj["chat_template"] is False  # the byte tokenizer has none
    assert obj["device"] == "cpu" and "kv_device_bytes" in obj["stats"] and "kv_gpu_bytes" not in obj["stats"]
    assert set(obj["stats"]) >= {"prefill_s", "decode_s", "ms_per_token", "tokens_per_s", "acceptance",
                                 "tokens_per_verification"}
    assert set(obj["stats"]["acceptance"]) == {"draft", "retrieval"}
    assert obj["method"] == "triforce" and len(obj["tokens"]) <= 12
    assert obj["prompt_tokens"] == len(byte_tokenizer().encode(DOC))
    assert obj["tokens"] == expected_tokens(models, DOC)
    assert obj["text"] == byte_tokenizer().decode(obj["tokens"], skip_special_tokens=True)
    assert r.stderr == ""  # --json: no summary line either


@pytest.mark.parametrize("policy", ["shared", "topk"])
def test_policy_option_keeps_greedy_output(runner, models, policy):
    r = run_pair(runner, models, str(models / "doc.txt"), *FAST, "--json", "--policy", policy, "--budget", "16",
                 "--chunk-size", "4")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["tokens"] == expected_tokens(models, DOC) and obj["stats"]["acceptance"]["retrieval"] is not None


def test_deterministic_flag_reaches_the_engine(runner, models, monkeypatch):
    """--deterministic: the full-cache level verifies row by row (greedy output still plain decoding's)."""
    from model_helpers import count_rowwise_runners

    built = count_rowwise_runners(monkeypatch)
    r = run_pair(runner, models, str(models / "doc.txt"), *FAST, "--json", "--deterministic", "--method", "triforce")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == expected_tokens(models, DOC) and built == [1]


def test_text_line_is_ended_only_when_stderr_shares_stdout(models):
    """`2>&1`: the summary line must not run on from the text; separate streams keep the exact text."""
    cmd = [sys.executable, "-m", "tforce", "run", "-m", str(models / "tiny-target"), "--method", "ar",
           "-p", "hi", "-n", "4", "--temperature", "0", "--threads", "1"]
    apart = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    joint = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           stdin=subprocess.DEVNULL)
    assert apart.returncode == joint.returncode == 0, apart.stderr
    text = apart.stdout
    assert text and not text.endswith("\n")  # the tiny model's 4 tokens end mid-line
    assert joint.stdout.startswith(text + "\ntforce: ar: 4 tokens"), joint.stdout


def test_streamed_text_is_the_only_stdout(runner, models):
    r = run_pair(runner, models, "-f", str(models / "doc.txt"), *FAST, "--method", "ar")
    assert r.exit_code == 0, r.output
    tokens = expected_tokens(models, DOC)
    assert r.stdout == byte_tokenizer().decode(tokens, skip_special_tokens=True)
    assert len(r.stderr.strip().splitlines()) == 1 and "tokens" in r.stderr  # the summary, on stderr


@pytest.mark.parametrize("file_args", [[], ["-"]])
def test_stdin_document_then_prompt(runner, models, file_args):
    r = run_pair(runner, models, *file_args, "--prompt", "Who?", *FAST, "--method", "ar", "--json", input=DOC)
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    text = DOC + "\n\nWho?"
    assert obj["prompt_tokens"] == len(byte_tokenizer().encode(text))
    assert obj["tokens"] == expected_tokens(models, text)


def test_prompt_text_alone(runner, models):
    r = run_pair(runner, models, "-p", "Hello there", *FAST, "--method", "retrieval", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == expected_tokens(models, "Hello there")


def test_sibling_draft_default(runner, models):
    r = runner.invoke(app, ["run", "-m", str(models / "tiny-target"), "-p", "Hi", *FAST, "-n", "3", "--json",
                            "--method", "triforce"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["method"] == "triforce"


def test_no_model_uses_the_demo_pair_and_excerpt(runner, tmp_path):
    """No --model: the demo pair (here tiny random stand-ins via TFORCE_DEMO_MODELS), said on stderr;
    no prompt either: the embedded excerpt + question, also said on stderr."""
    from tforce.text.demo import demo_prompt

    long_ctx = dict(TARGET, max_position_embeddings=16384)  # its tokenizer: ~1 id per character of the excerpt
    make_checkpoint(tmp_path / "demo-target", seed=0, **long_ctx)
    make_checkpoint(tmp_path / "demo-draft", seed=1, **dict(DRAFT, max_position_embeddings=16384))
    env = {"TFORCE_DEMO_MODELS": str(tmp_path)}
    r = runner.invoke(app, ["run", *FAST, "-n", "4", "--json"], input="", env=env)
    assert r.exit_code == 0, r.output
    assert "demo pair" in r.stderr and "demo's excerpt" in r.stderr
    target = tforce.load_model(str(tmp_path / "demo-target"))
    ids = target.tokenizer.encode(demo_prompt())
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == len(ids) > 2000
    assert out["tokens"] == tforce.generate(target.model, ids, method="ar", max_new_tokens=4, temperature=0).tokens
    # a prompt given with no model: the demo pair on that prompt
    r = runner.invoke(app, ["run", "-p", "Hello", *FAST, "-n", "2", "--json"], env=env)
    assert r.exit_code == 0 and "demo's excerpt" not in r.stderr, r.output
    assert json.loads(r.stdout)["prompt_tokens"] == len(target.tokenizer.encode("Hello"))
    # an empty prompt or file that was given is an error, not a cue for the excerpt
    one_error_line(runner.invoke(app, ["run", "-p", "  ", *FAST], input="", env=env), 2, "empty")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    one_error_line(runner.invoke(app, ["run", str(empty), *FAST], input="", env=env), 2, "empty")
    # no demo pair where it is looked for: one line, exit 2
    r = runner.invoke(app, ["run", "-p", "hi"], env={"TFORCE_DEMO_MODELS": str(tmp_path / "nowhere")})
    one_error_line(r, 2, "no --model given")


@pytest.mark.parametrize("args,code,needle", [
    (["-f", "/nonexistent/prompt.txt"], 2, "cannot read prompt file"),
    (["-p", "   "], 2, "empty"),
    (["-p", "x" * 600], 2, "context"),
    (["-p", "hi", "--gamma1", "0"], 2, "gamma1"),
    (["-p", "hi", "--gamma2", "-1"], 2, "gamma2"),
    (["-p", "hi", "--budget", "0"], 2, "budget"),
    (["-p", "hi", "--chunk-size", "0"], 2, "chunk-size"),
    (["-p", "hi", "--chunk-size", "16", "--budget", "8"], 2, "larger than --budget"),
    (["-p", "hi", "--temperature", "-0.5"], 2, "temperature"),
    (["-p", "hi", "--temperature", "inf"], 2, "temperature"),
    (["-p", "hi", "--temperature", "nan"], 2, "temperature"),
    (["-p", "hi", "--ignore-eos", "true"], 2, "flags: they take no value"),
    (["-p", "hi", "--top-p", "0"], 2, "top-p"),
    (["-p", "hi", "--top-p", "1.5"], 2, "top-p"),
    (["-p", "hi", "--method", "beam"], 2, "unknown method"),
    (["-p", "hi", "--policy", "oracle"], 2, "unknown policy"),
    (["-p", "hi", "--method", "streaming", "--policy", "h2o"], 2, "--method streaming has none"),  # was ignored
    (["-p", "hi", "--method", "ar", "--policy", "topk"], 2, "--policy topk chooses what the middle level's"),
    (["-p", "hi", "--device", "tpu"], 2, "--device"),
    (["-p", "hi", "--dtype", "int8"], 2, "--dtype"),
])
def test_bad_input_is_one_line(runner, models, args, code, needle):
    one_error_line(run_pair(runner, models, *args), code, needle)


def test_bad_models(runner, models):
    def run(*args):
        return runner.invoke(app, ["run", "-p", "hi", "--temperature", "0", "-n", "2", *args])

    one_error_line(run("-m", "no-such-model", "--method", "ar"), 2, "no-such-model")
    one_error_line(run("-m", str(models / "missing-folder"), "--method", "ar"), 2, "missing-folder")
    one_error_line(run("-m", str(models / "no-tokenizer"), "--method", "ar"), 2, "tokenizer")
    one_error_line(run("-m", str(models / "tiny-target"), "--draft", str(models / "other-vocab")), 2,
                   "larger than the target's")
    one_error_line(run("-m", str(models / "broken"), "--method", "ar"), 1, "target model: cannot read the weights")
    one_error_line(run("-m", str(models / "tiny-target"), "--draft", str(models / "no-such-draft")), 2)


LATIN1 = "caf\xe9 cr\xe8me, na\xefve".encode("latin-1")


@pytest.mark.parametrize("via", ["stdin", "file"])
def test_non_utf8_prompt_is_replaced_with_one_warning(runner, models, tmp_path, via):
    """A Latin-1 text reads the same from stdin and from a file: U+FFFD for each bad byte, one warning."""
    path = tmp_path / "latin1.txt"
    path.write_bytes(LATIN1)
    args = ["-"] if via == "stdin" else [str(path)]
    r = run_pair(runner, models, *args, *FAST, "--method", "ar", "--json", input=LATIN1 if via == "stdin" else None)
    assert r.exit_code == 0, (r.output, r.exception)
    text = LATIN1.decode("utf-8", errors="replace")
    assert json.loads(r.stdout)["tokens"] == expected_tokens(models, text)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: warning: ") and "not valid UTF-8" in lines[0], r.stderr


@pytest.mark.parametrize("via", ["stdin", "file"])
def test_binary_prompt_is_refused(runner, models, tmp_path, via):
    data = b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256))
    path = tmp_path / "prog"
    path.write_bytes(data)
    args = ["-"] if via == "stdin" else [str(path)]
    one_error_line(run_pair(runner, models, *args, "--method", "ar", input=data if via == "stdin" else None), 2,
                   "is not text")


def test_missing_target_is_named_before_the_draft(runner, models):
    """Without a draft for a missing target folder, the target is what is reported missing."""
    r = runner.invoke(app, ["run", "-p", "hi", "-m", str(models / "nowhere-target")])
    one_error_line(r, 2, "target model: no model folder")
    r = runner.invoke(app, ["run", "-p", "hi", "-m", str(models / "tiny-target"), "--draft", str(models / "nowhere")])
    one_error_line(r, 2, "draft model: no model folder")


@pytest.mark.parametrize("role", ["target", "draft"])
def test_corrupt_weights_name_the_file_and_the_role(runner, models, tmp_path, role):
    import shutil

    bad = tmp_path / "cut"
    shutil.copytree(models / f"tiny-{role}", bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    pair = {"target": models / "tiny-target", "draft": models / "tiny-draft", role: bad}
    r = runner.invoke(app, ["run", "-p", "hi", "-n", "2", "-m", str(pair["target"]), "--draft", str(pair["draft"])])
    one_error_line(r, 1, f"{role} model: cannot read the weights in {weights}")


def test_run_refuses_what_cannot_fit_before_loading(runner, models, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr("tforce.cli.common._host_available", lambda: 2**20)
    monkeypatch.setattr("tforce.model.weights.load_model", no_loading)
    r = run_pair(runner, models, "-p", "hi", "-n", "4")
    one_error_line(r, 1, "not enough memory")
    assert "KV cache for 6 tokens" in r.stderr and "GiB needed" in r.stderr and "0.0 GiB available" in r.stderr


def test_memory_check_plans_the_method_asked_for(runner, models, monkeypatch):
    """Host memory that holds ar's plan but not triforce's (its retrieval cache, the draft and its cache):
    --method ar runs, triforce is refused before loading, and auto leaves triforce out of its plan."""
    from transformers import AutoConfig

    from tforce.bench.suite import info_plan

    target, draft = (AutoConfig.from_pretrained(models / name) for name in ("tiny-target", "tiny-draft"))

    def need(method: str) -> int:  # as _check_memory plans "-p hi -n 4" (6 tokens) in float32 on the CPU
        plan = info_plan(target, 6, 4, None, 2**40, "auto", 4096, draft_config=draft, context_bytes=0,
                         attention="math", method=method)
        return plan["peak_bytes"] + plan["host_kv_bytes"]

    assert need("ar") < need("triforce")
    monkeypatch.setattr("tforce.cli.common._host_available", lambda: (need("ar") + need("triforce")) // 2)
    r = run_pair(runner, models, "-p", "hi", "-n", "4", "--method", "ar", "--temperature", "0")
    assert r.exit_code == 0, (r.output, r.exception)
    one_error_line(run_pair(runner, models, "-p", "hi", "-n", "4", "--method", "triforce"), 1, "not enough memory")
    auto = run_pair(runner, models, "-p", "hi", "-n", "4", "--temperature", "0", "--json", "--method", "auto")
    assert auto.exit_code == 0, (auto.output, auto.exception)
    planned = {c["method"] for c in json.loads(auto.stdout)["auto"]["candidates"]}
    assert "ar" in planned and "triforce" not in planned


def test_context_full_is_said(runner, models):
    """-n beyond the context: generation stops where the context ends, and stderr says so."""
    r = run_pair(runner, models, "-p", "x" * 500, *FAST, "-n", "30", "--method", "ar", "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert len(json.loads(r.stdout)["tokens"]) == 12
    assert "leaves room for 12 new tokens after the 500-token prompt, not the 30 asked for" in r.stderr


def test_gpu_memory_on_cpu_is_said(runner, models):
    r = run_pair(runner, models, "-p", "hi", *FAST, "--method", "ar", "--device", "cpu", "--gpu-memory", "1GiB")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "--gpu-memory has no effect on a cpu run" in r.stderr


@pytest.mark.parametrize("command", [[], ["run"], ["bench"], ["info"], ["eval"]])
def test_flags_read_as_flags_in_help(runner, command):
    """No `<bool>` / BOOLEAN type on a flag: Typer's rich panels put `<bool>` on --help itself."""
    r = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "120"})
    assert r.exit_code == 0
    assert "--help" in r.stdout
    assert "<bool>" not in r.stdout and "BOOLEAN" not in r.stdout, r.stdout


def test_no_command_shows_the_help(monkeypatch, capsys):
    """`tforce` alone: the commands listed on stderr, exit 2 (Click's plain layout prints the help only
    when asked to)."""
    from tforce.cli import main

    monkeypatch.setattr(sys, "argv", ["tforce"])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Usage:" in err and "run" in err and "bench" in err


def test_unreadable_prompt_file_and_empty_stdin(runner, models):
    one_error_line(run_pair(runner, models, str(models)), 2, "cannot read prompt file")
    one_error_line(run_pair(runner, models, "-", input=""), 2, "empty")


def test_debug_reraises(runner, models):
    r = run_pair(runner, models, "-p", "hi", "--gamma1", "0", env={"TFORCE_DEBUG": "1"})
    assert r.exit_code != 0
    assert isinstance(r.exception, tforce.UsageError)


def test_keyboard_interrupt_exits_130(runner, models, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tforce.engine.generate, "generate", interrupted)
    r = run_pair(runner, models, "-p", "hi", "--method", "ar")
    assert r.exit_code == 130
    assert "Traceback" not in r.output and r.stdout == ""


def test_info(runner, models):
    r = runner.invoke(app, ["info"])
    assert r.exit_code == 0, r.output
    assert "torch" in r.stdout
    r = runner.invoke(app, ["info", "--json", "-m", str(models / "tiny-target"), "--context", "1000"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    m = obj["model"]
    assert (m["layers"], m["heads"], m["kv_heads"], m["head_dim"], m["context"]) == (2, 4, 2, 16, 512)
    assert m["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # K and V, layers, kv heads, head dim, bf16
    assert m["kv_bytes_for_context"] == 1000 * m["kv_bytes_per_token"]
    assert "host_memory_bytes" in obj and "torch" in obj
    r = runner.invoke(app, ["info", "-m", str(models / "tiny-target")])
    assert r.exit_code == 0 and "RANDOM WEIGHTS" in r.stdout
    one_error_line(runner.invoke(app, ["info", "-m", "no-such-model"]), 2, "no-such-model")


@pytest.mark.parametrize("argv,needle", [
    (["run", "-m", "x", "-p", "hi", "-n", "abc"], "--max-new-tokens"),
    (["run", "-m", "x", "-p", "hi", "--top-k", "many"], "--top-k"),
    (["run", "-m", "x", "--frob"], "--frob"),
    (["bogus"], "bogus"),
])
def test_main_turns_parse_errors_into_one_line(monkeypatch, capsys, argv, needle):
    from tforce.cli import main

    monkeypatch.setattr("sys.argv", ["tforce", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("command", ["run", "chat"])
def test_prefill_chunk_reaches_the_engine(runner, models, monkeypatch, command):
    """--prefill-chunk: the prompt's tokens per prefill forward, in run and chat alike; 0 refused in one line."""
    seen = session_configs(monkeypatch)
    base = [command, "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"), *FAST, "--method",
            "triforce"]
    source = ["--prompt", DOC] if command == "run" else [str(models / "doc.txt"), "--questions", "-"]
    result = runner.invoke(app, base + source + ["--prefill-chunk", "16"], input="Who?\n")
    assert result.exit_code == 0, (result.output, result.exception)
    assert [c.execution.prefill_chunk for c in seen] == [16]
    one_error_line(runner.invoke(app, base + source + ["--prefill-chunk", "0"], input="Who?\n"), 2, "--prefill-chunk")


@pytest.mark.parametrize("args, noted", [
    (["--dtype", "bfloat16"], True),
    (["--dtype", "float16", "--method", "retrieval"], True),
    (["--dtype", "bfloat16", "--deterministic"], False),
    (["--dtype", "bfloat16", "--method", "ar"], False),
    (["--dtype", "float32"], False),
])
def test_greedy_in_16_bits_says_what_exact_means(runner, models, args, noted):
    r = run_pair(runner, models, str(models / "doc.txt"), *FAST, "--json", "--device", "cpu", *args)
    assert r.exit_code == 0, (r.output, r.exception)
    assert ("except where its two best logits nearly tie" in r.stderr) == noted, r.stderr


def test_the_version_is_pyproject_s():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert tforce.__version__ == project["version"]


def test_run_chat_and_serve_take_the_shared_options_from_one_place():
    """cli/options.SHARED is declared once; each command shows every one of its options (serve: no KV
    snapshots, and its own help for the request defaults) and the engine's defaults (config.py)."""
    from typer.main import get_command

    from tforce.cli import options as o
    from tforce.config import Sampling, Speculation

    commands = get_command(app).commands
    for name, snapshots in (("run", True), ("chat", True), ("serve", False)):
        params = {p.name: p for p in commands[name].params}
        expected = set(o.SHARED) - (set() if snapshots else {"save_kv", "load_kv"})
        assert expected <= set(params) and "opts" not in params, name
        assert params["budget"].default == Speculation.budget and params["top_p"].default == Sampling.top_p
    assert "when a request gives none" in {p.name: p for p in commands["serve"].params}["temperature"].help


def test_info_plans_int4_weights_and_refuses_an_unknown_form(runner):
    """`tforce info --weights int4`: the layers' projections at about a quarter of their bfloat16 bytes in the
    plan (the tables and norms stay bfloat16), more of the KV cache on the GPU; a bad value is one line."""
    base = ["info", "--synthetic", "llama3.1-8b", "--context", "131072", "--gpu-memory", "24GiB", "--json"]
    plain = json.loads(runner.invoke(app, base).stdout)["plan"]
    int4 = json.loads(runner.invoke(app, base + ["--weights", "int4"]).stdout)["plan"]
    assert 0.3 < int4["weights_bytes"] / plain["weights_bytes"] < 0.45
    assert int4["resident_layers"] > plain["resident_layers"]
    one_error_line(runner.invoke(app, ["info", "--synthetic", "tiny", "--weights", "int3"]), 2, "--weights")
