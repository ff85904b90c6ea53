"""`tforce bench --peers llama.cpp`: llama-bench on the same GGUF at the prompt's depth (tforce/bench/llamacpp.py).

No llama.cpp build exists where the tests run, so a stand-in `llama-bench` (a shell script) records the
arguments it was given and prints what a real one prints (the JSON fields read here are those of
llama.cpp's tools/llama-bench); the real one's figures are in BENCHMARKS.md."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gguf_files import write_llama
from tforce import cpu_features
from tforce.bench import llamacpp, peers
from tforce.cli import app

# What llama-bench -o json printed for one test (llama.cpp build 9993 on the 2-core CPU), fields trimmed.
SAMPLE = [{"build_commit": "1d0c4a9", "build_number": 9993, "model_type": "llama ?B Q4_1",
           "n_threads": 2, "n_prompt": 0, "n_gen": 16, "n_depth": 300, "avg_ns": 400000000,
           "avg_ts": 40.0, "stddev_ts": 0.0}]


def _stand_in(folder: Path, stdout: str, code: int = 0) -> Path:
    """A llama-bench that writes its arguments to args.txt beside it and prints `stdout`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "out.json").write_text(stdout)
    script = folder / "llama-bench"
    script.write_text(f'#!/bin/sh\necho "$@" > "{folder}/args.txt"\ncat "{folder}/out.json"\n'
                      f'echo "llama-bench: a line on stderr" >&2\nexit {code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFORCE_CACHE", str(root / "cache"))
        yield write_llama(root / "tiny.gguf")


@pytest.fixture
def cache(gguf, monkeypatch):
    monkeypatch.setenv("TFORCE_CACHE", str(gguf.parent / "cache"))


def test_parse_reads_the_decode_rate():
    got = llamacpp.parse("some line of its own [with brackets]\n" + json.dumps(SAMPLE, indent=2) + "\ntrailing\n")
    assert got["ms_per_token"] == pytest.approx(25.0) and got["threads"] == 2 and got["depth"] == 300
    assert got["version"] == "llama.cpp build 9993 (1d0c4a9)" and got["weights"] == "llama ?B Q4_1"
    for bad in ("", "[]", "not json", "[1]", "[{}]", json.dumps([{"avg_ts": 0}]), json.dumps([{"avg_ts": "x"}])):
        with pytest.raises(ValueError):
            llamacpp.parse(bad)


def test_the_binary_is_found_in_the_build_tree_then_on_path(tmp_path, monkeypatch):
    built = _stand_in(tmp_path / "tree" / "build" / "bin", "[]")
    on_path = _stand_in(tmp_path / "elsewhere", "[]")
    monkeypatch.setenv("PATH", f"{on_path.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "tree"))
    assert llamacpp.find_binary() == built
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "nothing here"))
    assert llamacpp.find_binary() == on_path
    monkeypatch.delenv("LLAMA_CPP_DIR")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert llamacpp.find_binary() is None


def test_record_runs_one_test_at_the_prompts_depth(tmp_path, monkeypatch):
    script = _stand_in(tmp_path / "bin", json.dumps(SAMPLE))
    monkeypatch.setenv("LLAMA_CPP_DIR", str(script.parent))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    rec = llamacpp.record(tmp_path / "m.gguf", torch.device("cpu"), 300, 16)
    assert rec["skipped"] is None and rec["ms_per_token"] == pytest.approx(25.0)
    assert rec["decode_s"] == pytest.approx(0.4) and rec["tokens"] == 16 and rec["vs_ar"] is None
    args = (script.parent / "args.txt").read_text().split()
    assert args == ["-m", str(tmp_path / "m.gguf"), "-p", "0", "-n", "16", "-d", "300", "-t", "3", "-r", "1",
                    "-o", "json"]


@pytest.mark.parametrize("gguf_file, device, binary, needle", [
    (None, "cpu", True, "not a GGUF file"),
    ("m.gguf", "cuda", True, "CPU only"),
    ("m.gguf", "cpu", False, "no llama-bench found"),
])
def test_skips_say_why(tmp_path, monkeypatch, gguf_file, device, binary, needle):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    if binary:
        monkeypatch.setenv("LLAMA_CPP_DIR", str(_stand_in(tmp_path / "bin", json.dumps(SAMPLE)).parent))
    else:
        monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    rec = llamacpp.record(None if gguf_file is None else tmp_path / gguf_file, torch.device(device), 300, 16)
    assert needle in rec["skipped"] and rec["ms_per_token"] is None


@pytest.mark.parametrize("stdout, code, needle", [("[]", 0, "no test result"), ("x", 1, "exit 1: llama-bench: a line")])
def test_a_failing_binary_is_one_line(tmp_path, monkeypatch, stdout, code, needle):
    monkeypatch.setenv("LLAMA_CPP_DIR", str(_stand_in(tmp_path / "bin", stdout, code).parent))
    rec = llamacpp.record(tmp_path / "m.gguf", torch.device("cpu"), 300, 16)
    assert rec["skipped"].startswith("failed: ValueError") and needle in rec["skipped"], rec["skipped"]


def test_parse_peers_takes_llama_cpp():
    assert peers.parse_peers("llama.cpp") == ("llama.cpp",)
    assert peers.parse_peers("hf,llama.cpp") == peers.FAMILIES["hf"] + ("llama.cpp",)


BENCH = ["bench", "--device", "cpu", "--prompt-len", "40", "--gen-len", "6", "--temperature", "0",
         "--threads", "1", "--methods", "ar"]


def test_bench_puts_llama_cpp_beside_ar(gguf, cache, tmp_path, monkeypatch):
    """End to end: the GGUF's own path reaches llama-bench, its rate sits in the table and the JSON."""
    script = _stand_in(tmp_path / "bin", json.dumps(SAMPLE))
    monkeypatch.setenv("LLAMA_CPP_DIR", str(script.parent))
    runner = CliRunner()
    result = runner.invoke(app, BENCH + ["-m", str(gguf), "--peers", "llama.cpp", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    (peer,) = report["peers"]
    ar = report["runs"][0]["ms_per_token"]
    assert peer["method"] == "llama.cpp" and peer["ms_per_token"] == pytest.approx(25.0)
    assert peer["speedup_vs_ar"] == pytest.approx(ar / 25.0)
    assert report["cpu"] == cpu_features.describe()  # which kernels the two ran on: AVX2, native bf16 or not
    args = (script.parent / "args.txt").read_text().split()
    assert args[args.index("-m") + 1] == str(gguf) and args[args.index("-d") + 1] == "40"
    table = runner.invoke(app, BENCH + ["-m", str(gguf), "--peers", "llama.cpp"])
    assert table.exit_code == 0, table.output
    assert "llama.cpp (peer)" in table.stdout and "25.0" in table.stdout
    assert "llama.cpp: llama.cpp build 9993 (1d0c4a9), llama-bench on the same GGUF" in table.stdout


def test_bench_of_a_safetensors_model_says_why_llama_cpp_did_not_run(tmp_path, monkeypatch):
    from tforce.model.synthetic import make_checkpoint

    make_checkpoint(tmp_path / "m", seed=0)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(_stand_in(tmp_path / "bin", json.dumps(SAMPLE)).parent))
    result = CliRunner().invoke(app, BENCH + ["-m", str(tmp_path / "m"), "--peers", "llama.cpp"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "llama.cpp: not run: the model is not a GGUF file" in result.stdout
