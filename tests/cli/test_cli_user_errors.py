"""What a new user gets wrong, found by walking through the README: each mistake is one stderr line and a
non-zero exit, nothing the user gave is destroyed, and the README's notices hold in every mode."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tforce.cli import app
from tforce.model.synthetic import make_checkpoint

from cli_helpers import DRAFT, TARGET
from user_errors_helpers import one_error_line, run_hi
from user_errors_helpers import models  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.mark.parametrize("args,role", [
    (["run", "-p", "hi", "--method", "ar", "-m", "{gpt2}"], "target model"),
    (["run", "-p", "hi", "-m", "{target}", "--draft", "{gpt2}"], "draft model"),
    (["chat", "{doc}", "-q", "{doc}", "--method", "ar", "-m", "{gpt2}"], "target model"),
    (["info", "-m", "{gpt2}"], ""),
])
def test_unsupported_architecture_is_a_usage_error(runner, models, args, role):
    """A config of another architecture is refused by its model type before anything reads its fields (it
    was an AttributeError from the memory plan, exit 1)."""
    paths = {"gpt2": models / "gpt2", "target": models / "tiny-target", "doc": models / "doc.txt"}
    r = runner.invoke(app, [a.format(**paths) for a in args])
    one_error_line(r, 2, f"{role}: {paths['gpt2']}: model type 'gpt2' is not a Llama-family model".lstrip(": "))


def test_save_kv_keeps_a_folder_whose_manifest_is_not_tforces(runner, models, tmp_path):
    """A folder holding some other program's manifest.json is not a snapshot: it was taken for one and
    replaced, everything in it deleted."""
    app_folder = tmp_path / "extension"
    app_folder.mkdir()
    (app_folder / "manifest.json").write_text('{"name": "my extension", "version": "1.0"}')
    (app_folder / "background.js").write_text("keep me")
    one_error_line(run_hi(runner, models, "--save-kv", str(app_folder)), 2, "not a tforce KV snapshot; refusing")
    assert sorted(p.name for p in app_folder.iterdir()) == ["background.js", "manifest.json"]
    assert (app_folder / "background.js").read_text() == "keep me"


def test_save_kv_where_no_folder_can_be_made_is_refused_before_the_run(runner, models, tmp_path):
    """A path under a file cannot become a folder: one usage line before any weights are read (it was a
    FileExistsError after the prefill), and the file is untouched."""
    (tmp_path / "notes.txt").write_text("keep me")
    r = run_hi(runner, models, "--save-kv", str(tmp_path / "notes.txt" / "snap"))
    one_error_line(r, 2, f"--save-kv {tmp_path / 'notes.txt' / 'snap'}: {tmp_path / 'notes.txt'} is not a folder")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_a_disk_error_while_saving_is_one_line(runner, models, tmp_path, monkeypatch):
    """A snapshot the disk refuses (full, read-only, /proc) was an OSError with the debugging hint: now one
    line naming --save-kv, exit 1, and no temporary folder left behind."""
    import errno

    from tforce.snapshot import store as snapshot_io

    def full(folder, name, tensors):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot_io, "_write", full)
    r = run_hi(runner, models, "--save-kv", str(tmp_path / "snap"), "--method", "triforce")  # no line from auto
    one_error_line(r, 1, f"--save-kv {tmp_path / 'snap'}: cannot write the snapshot: No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_batch_without_a_model_says_it_uses_the_demo_pair(runner, models, tmp_path):
    """README: without --model, the demo pair, said on stderr; a batch ran it without a word."""
    batch = tmp_path / "prompts.jsonl"
    batch.write_text('{"prompt": "Hello"}\n')
    demo = tmp_path / "demo"
    demo.mkdir()
    for role in ("target", "draft"):
        (demo / f"demo-{role}").symlink_to(models / f"tiny-{role}")
    env = {"TFORCE_DEMO_MODELS": str(demo)}
    r = runner.invoke(app, ["run", "--batch", str(batch), "-n", "2", "-t", "0"], env=env)
    assert r.exit_code == 0, r.output
    assert f"no --model given: using the trained demo pair {demo / 'demo-target'}" in r.stderr.splitlines()[0]
    assert json.loads(r.stdout)["id"] == 1
    # with another --draft, the line no longer calls that draft one of the trained demo pair
    r = runner.invoke(app, ["run", "--batch", str(batch), "-n", "2", "-t", "0", "--draft", str(models / "tiny-target")],
                      env=env)
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0] == (
        f"tforce: no --model given: using the trained demo target {demo / 'demo-target'} (a small model trained by "
        f"scripts/train_demo.py, see models/README.md) with the draft {models / 'tiny-target'}")


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_chat_with_no_questions_in_the_file_is_refused(runner, models, tmp_path, content):
    """An empty questions file prefilled the document, answered nothing and exited 0; now one usage line
    before any weights are read. With --save-kv the snapshot is the point: it is written."""
    questions = tmp_path / "questions.txt"
    questions.write_text(content)
    pair = ["-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft")]
    r = runner.invoke(app, ["chat", str(models / "doc.txt"), "-q", str(questions), *pair])
    one_error_line(r, 2, f"questions file {questions} holds no questions")
    r = runner.invoke(app, ["chat", str(models / "doc.txt"), "-q", str(questions), *pair,
                            "--save-kv", str(tmp_path / "snap")])
    assert r.exit_code == 0 and r.stdout == "", r.output
    assert (tmp_path / "snap" / "manifest.json").is_file()


@pytest.mark.parametrize("stdin", ["", "\n  \n\n"])
def test_chat_with_no_questions_on_stdin_is_refused(runner, models, tmp_path, monkeypatch, stdin):
    """`tforce chat book.txt < /dev/null` prefilled the document, answered nothing and exited 0; now one usage
    line before any weights are read, as for an empty questions file. With --save-kv the snapshot is written."""
    import tforce.model.weights

    pair = ["-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft")]
    with monkeypatch.context() as m:
        m.setattr(tforce.model.weights, "load_model", _no_loading)
        for given in ([], ["-q", "-"]):
            r = runner.invoke(app, ["chat", str(models / "doc.txt"), *given, *pair], input=stdin)
            one_error_line(r, 2, "stdin holds no questions (one a line)")
    r = runner.invoke(app, ["chat", str(models / "doc.txt"), *pair, "--save-kv", str(tmp_path / "snap")], input=stdin)
    assert r.exit_code == 0 and r.stdout == "", r.output
    assert (tmp_path / "snap" / "manifest.json").is_file()


def test_chat_with_an_empty_document_names_the_document(runner, models, tmp_path):
    """An empty BOOK, or nothing on stdin without BOOK: the line spoke of a prompt and --prompt, which chat
    does not have."""
    pair = ["-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft")]
    (tmp_path / "empty.txt").write_text("  \n")
    for args, stdin in (([str(tmp_path / "empty.txt"), "-q", str(tmp_path / "empty.txt")], None), ([], "")):
        r = runner.invoke(app, ["chat", *args, *pair], input=stdin)
        one_error_line(r, 2, "the document is empty: give BOOK")


def _no_loading(*a, **k):
    raise AssertionError("weights read before the questions were checked")


def test_chat_names_the_demo_excerpt_as_run_does(monkeypatch, capsys):
    """chat called the excerpt 'chapter 1'; it holds chapters 1-2, as run says."""
    import io

    from tforce.cli.chat_input import read_document
    from tforce.text.demo import EXCERPT

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    text, from_stdin = read_document(None, None, True)
    assert text == EXCERPT.read_text(encoding="utf-8").strip() and not from_stdin
    assert capsys.readouterr().err == ("tforce: no document given: using the demo's excerpt (Great Expectations, "
                                       "chapters 1-2)\n")


@pytest.mark.parametrize("args", [["--batch", "4"], ["--context", "1000"], ["--gpu-memory", "24GiB"], ["--gpus", "2"]])
def test_info_planning_options_without_a_model_are_refused(runner, args):
    """`tforce info --batch 4` printed the versions alone, as if the plan asked for fitted: the planning
    options need a model to plan."""
    one_error_line(runner.invoke(app, ["info", *args]), 2, f"{args[0]} plans a model: give --model or --synthetic")


def test_load_kv_of_what_is_not_a_snapshot_is_a_usage_error(runner, models, tmp_path):
    """A folder without a manifest was exit 1 with '(FileNotFoundError)'; a file was 'no such snapshot
    folder' though it exists: both are bad input, said plainly."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    one_error_line(run_hi(runner, models, "--load-kv", str(tmp_path / "notes")), 2,
                   "not a readable tforce KV snapshot (no manifest.json)")
    one_error_line(run_hi(runner, models, "--load-kv", str(tmp_path / "notes.txt")), 2,
                   f"--load-kv {tmp_path / 'notes.txt'}: a file, not a snapshot folder")


@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1)])
def test_a_seed_torch_cannot_take_is_a_usage_error(runner, models, seed):
    """--seed 99999999999999999999 loaded the models, then failed with 'ValueError: Overflow when unpacking
    long long' (exit 1)."""
    one_error_line(run_hi(runner, models, "--seed", seed), 2, f"--seed must be in [-2**63, 2**64), got {seed}")


def test_the_extreme_seeds_torch_takes_still_run(runner, models):
    for seed in (str(2**64 - 1), str(-2**63)):
        assert run_hi(runner, models, "--seed", seed).exit_code == 0


def test_batch_refuses_its_options_before_loading(runner, models, tmp_path, monkeypatch):
    """README: options are checked before any model is loaded; a --batch refusal (once --policy h2o, read by
    generate_batch after both models' weights) comes before any weights are read."""
    import tforce.model.weights

    def no_loading(*a, **k):
        raise AssertionError("weights read before the options were checked")

    monkeypatch.setattr(tforce.model.weights, "load_model", no_loading)
    batch = tmp_path / "prompts.jsonl"
    batch.write_text('{"prompt": "Hello"}\n')
    r = runner.invoke(app, ["run", "-m", str(models / "tiny-target"), "--batch", str(batch), "--save-kv",
                            str(tmp_path / "kv")])
    one_error_line(r, 2, "--batch saves no KV snapshot")


def test_eval_out_that_is_a_file_is_refused_before_the_work(runner, models, tmp_path, monkeypatch):
    """tforce eval --out FILE ran the whole evaluation, then lost it to a FileExistsError when writing;
    the file is refused first, and kept."""
    import tforce.model.weights

    def no_loading(*a, **k):
        raise AssertionError("the evaluation started before --out was checked")

    monkeypatch.setattr(tforce.model.weights, "load_model", no_loading)
    (tmp_path / "notes.txt").write_text("keep me")
    r = runner.invoke(app, ["eval", "-m", str(models / "tiny-target"), "--books", str(models / "doc.txt"),
                            "--out", str(tmp_path / "notes.txt")])
    one_error_line(r, 2, f"--out {tmp_path / 'notes.txt'}: a file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def _closed(models, fd: int, *args):
    import os
    import subprocess
    import sys

    base = [sys.executable, "-m", "tforce", "run", "-m", str(models / "tiny-target"), "--method", "ar", "-n", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(base + list(args), capture_output=fd == 0, stdout=None if fd == 0 else subprocess.PIPE,
                          stderr=None if fd == 0 else subprocess.PIPE, text=True, env=env, timeout=120,
                          preexec_fn=lambda: os.close(fd))


def test_a_closed_stdin_reads_as_empty(models):
    """Started with stdin closed (`tforce run ... <&-`, some service managers) every command failed with
    "AttributeError: 'NoneType' object has no attribute 'isatty'": a closed stdin is an empty one."""
    r = _closed(models, 0, "-p", "hi", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["prompt_tokens"] > 0, r.stderr
    r = _closed(models, 0)
    assert r.returncode == 2 and r.stderr == "tforce: error: the prompt is empty: give a prompt file, --prompt " \
        "TEXT or text on stdin\n", r.stderr


def test_a_closed_stderr_drops_the_diagnostics_and_a_closed_stdout_is_said(models):
    """2>&- made every run fail (exit 1, silently: the error had nowhere to go either); >&- was an
    AttributeError. Without stderr the run still writes its data; without stdout it says why it stops."""
    r = _closed(models, 2, "-p", "hi", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["prompt_tokens"] > 0
    r = _closed(models, 1, "-p", "hi")
    assert r.returncode == 1 and r.stderr == "tforce: error: stdout is closed: the output has nowhere to go\n", r.stderr


def test_non_utf8_prompt_argument_and_piped_questions_read_as_files_do(runner, models):
    """README: bytes that are not UTF-8 become U+FFFD with one warning. From a Latin-1 terminal, -p 'caf\\xe9'
    (which Python hands over as a lone surrogate) and questions piped to chat were TypeErrors in the tokenizer."""
    pair = ["-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"), "-n", "2", "-t", "0",
            "--method", "triforce"]  # a named method: no line from auto beside the warning
    r = runner.invoke(app, ["run", *pair, "-p", "caf\udce9", "--json"])
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith("tforce: warning: --prompt is not valid UTF-8") and len(r.stderr.splitlines()) == 1
    same = runner.invoke(app, ["run", *pair, "-p", "caf\ufffd", "--json"])
    assert json.loads(r.stdout)["tokens"] == json.loads(same.stdout)["tokens"]
    r = runner.invoke(app, ["chat", str(models / "doc.txt"), *pair, "--json"], input=b"Who \xe9?\n")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["question"] == "Who \ufffd?" and "not valid UTF-8" in r.stderr


def test_a_question_typed_in_latin1_reads_as_piped_ones_do(monkeypatch, capsys):
    """At a Latin-1 terminal, input() hands over the bytes that are not UTF-8 as lone surrogates."""
    from tforce.cli import chat_input

    typed = ["Who \udce9?"]

    def typing(*_):
        if not typed:
            raise EOFError  # Ctrl-D
        return typed.pop()

    monkeypatch.setattr("builtins.input", typing)
    assert list(chat_input._terminal_questions()) == ["Who \ufffd?"]
    assert "not valid UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "chat", "bench"])
def test_draft_help_names_the_sibling_default(runner, command):
    """--help said the draft defaults to 'the registry's' only; a folder X-target takes its sibling X-draft
    (and run and chat without --model, the demo pair's draft)."""
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "300"})
    assert "sibling X-draft" in r.stdout, r.stdout


def test_a_config_transformers_refuses_says_why(runner, models, tmp_path):
    """transformers' message ends its first line at 'validator ...:' and gives the reason on the next:
    the one line kept both (it showed only 'Class validation error for validator ...:')."""
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**json.loads((models / "tiny-target" / "config.json").read_text()),
                                                 "num_attention_heads": 3}))
    one_error_line(runner.invoke(app, ["info", "-m", str(odd)]), 2,
                   "is not a multiple of the number of attention heads (3)")


def test_version_prints_one_line():
    from tforce import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"tforce {__version__}\n"


def test_a_plan_for_no_device_does_not_claim_a_gpu():
    """`tforce info -m MODEL` on a machine without CUDA plans for the CPU: its line says so."""
    from tforce.engine import placement

    target = placement.Shape(4, 64, 128, 4, 2, 16, 100, 4, 10_000)
    work = placement.Work(capacity=64, prompt=32)
    cpu = placement.plan(target, work, "auto", None, 2**40)
    assert cpu.describe() == "all 4 layers in the CPU's memory (no GPU)"
    gpu = placement.plan(target, work, "auto", 2**30, 2**40)
    assert gpu.describe() == "4 of 4 layers on the GPU (0.0 GiB), 0 in pinned host memory (0.0 GiB)"
    host = placement.plan(target, work, "on", 2**30, 2**40)  # the staging buffers are on the GPU's share
    assert host.describe() == ("0 of 4 layers on the GPU (0.0 GiB with the two staging buffers), "
                               "4 in pinned host memory (0.0 GiB)")


def test_info_says_the_kv_plan_in_one_sentence(runner, models):
    """The plan line read "4/4 layers of KV in the CPU's memory (no GPU) of 0.01 GiB KV for 4096 tokens";
    it now starts with the cache's size, then says where its layers go."""
    r = runner.invoke(app, ["info", "-m", str(models / "tiny-target"), "--context", "256"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    [line] = [x for x in r.stdout.splitlines() if "placement plan" in x]
    said = line.split("placement plan", 1)[1].strip()
    assert said.startswith("KV cache: 0.00 GiB for 256 tokens, ")
    assert said.endswith("all 2 layers in the CPU's memory (no GPU)") or " layers on the GPU (" in said, said


def test_a_refused_prompt_is_the_only_line_after_the_notes(runner, models, tmp_path):
    """The exactness note (greedy in bfloat16), the --gpu-memory note and the demo notice were written before
    the prompt was laid out, so a prompt the chat template step refuses (--system on a model without one)
    came after them: now they follow the prompt's checks, in run, --batch and chat."""
    pair = ["-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft")]
    noted = [*pair, "--dtype", "bfloat16", "-t", "0", "--gpu-memory", "1GB", "--system", "Be brief."]
    one_error_line(runner.invoke(app, ["run", str(models / "doc.txt"), *noted]), 2, "has no chat template")
    one_error_line(runner.invoke(app, ["chat", str(models / "doc.txt"), *noted], input="Who?\n"), 2,
                   "has no chat template")
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"prompt": "Who?"}) + "\n")
    one_error_line(runner.invoke(app, ["run", "--batch", str(batch), *noted]), 2, "has no chat template")
    make_checkpoint(tmp_path / "demo-target", seed=0, **TARGET)
    make_checkpoint(tmp_path / "demo-draft", seed=1, **DRAFT)
    r = runner.invoke(app, ["run", "-p", "Hello", "--system", "Be brief."], env={"TFORCE_DEMO_MODELS": str(tmp_path)})
    one_error_line(r, 2, "has no chat template")
