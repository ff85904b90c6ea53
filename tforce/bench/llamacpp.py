"""`tforce bench --peers llama.cpp`: llama.cpp's own decode speed on the same GGUF file at the same depth.

llama.cpp is what a GGUF user already has, so it is the peer that answers "is tforce worth it" for such a
file. It runs as its own program, `llama-bench`, found as `$LLAMA_CPP_DIR/build/bin/llama-bench` (a source
tree built by scripts/build_llama_cpp.sh), `$LLAMA_CPP_DIR/llama-bench`, or `llama-bench` on PATH. One
call, `llama-bench -m FILE -p 0 -n GEN_LEN -d PROMPT_LEN -t THREADS -r 1 -o json`, times GEN_LEN new
tokens after a cache of PROMPT_LEN tokens (the depth, filled first and not timed), with as many threads as
tforce's own run (torch.get_num_threads()). That is the figure tforce's ms/token is: decoding only, at the
prompt's length. What differs, and the table's notes say so: llama.cpp reads the file's own quantized
weights (tforce converts them), and fills the depth with its own tokens, not the prompt's (a decode
step's cost does not depend on which tokens are cached). So no tokens are compared.

CPU only: a CUDA bench would compare a GPU run with whatever the found build does.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import torch

BINARY = "llama-bench"
TIMEOUT_S = 1800  # a depth of 100K tokens takes minutes to fill on a small CPU; a hung binary must not hang bench


def find_binary() -> Path | None:
    """llama-bench from $LLAMA_CPP_DIR (its build/bin, then the folder itself), else from PATH."""
    root = os.environ.get("LLAMA_CPP_DIR")
    if root:
        for candidate in (Path(root) / "build" / "bin" / BINARY, Path(root) / BINARY):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which(BINARY)
    return Path(found) if found else None


def skip_reason(gguf: Path | None, device: torch.device, binary: Path | None) -> str | None:
    if gguf is None:
        return "the model is not a GGUF file (llama.cpp reads only GGUF)"
    if device.type != "cpu":
        return "compared on the CPU only"
    if binary is None:
        return ("no llama-bench found: set LLAMA_CPP_DIR to a llama.cpp build (scripts/build_llama_cpp.sh) "
                "or put llama-bench on PATH")
    return None


def command(binary: Path, gguf: Path, prompt_len: int, gen_len: int, threads: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "-p", "0", "-n", str(gen_len), "-d", str(prompt_len),
            "-t", str(threads), "-r", "1", "-o", "json"]


def parse(stdout: str) -> dict:
    """llama-bench's JSON (a list with one test) -> {ms_per_token, version, threads, depth}."""
    # some builds print lines of their own before the JSON: it starts at the first line that opens a list
    lines = stdout.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("[")), None)
    tests = json.JSONDecoder().raw_decode("".join(lines[start:]).lstrip())[0] if start is not None else []
    if not isinstance(tests, list) or not tests or not isinstance(tests[0], dict) or not tests[0].get("avg_ts"):
        raise ValueError("llama-bench printed no test result")
    t = tests[0]
    version = f"llama.cpp build {t.get('build_number', '?')} ({t.get('build_commit', '?')})"
    try:
        rate = float(t["avg_ts"])
    except (TypeError, ValueError):
        raise ValueError(f"llama-bench's avg_ts is not a number: {t['avg_ts']!r}") from None
    return {"ms_per_token": 1000.0 / rate, "version": version, "threads": t.get("n_threads"),
            "depth": t.get("n_depth"), "weights": t.get("model_type")}


def record(gguf: Path | None, device: torch.device, prompt_len: int, gen_len: int, run=subprocess.run) -> dict:
    """bench's peer record for llama.cpp (the "peers" list's shape; see peers.py)."""
    binary = find_binary()
    rec = {"method": "llama.cpp", "peer": "llama.cpp", "attention": "its own", "tokens": 0, "ms_per_token": None,
           "speedup_vs_ar": None, "tokens_per_verification": None, "prefill_s": None, "decode_s": None,
           "gpu_mem_gib": None, "vs_ar": None, "skipped": skip_reason(gguf, device, binary)}
    if rec["skipped"]:
        return rec
    cmd = command(binary, gguf, prompt_len, gen_len, torch.get_num_threads())
    try:
        done = run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [""])[-1][:200]
            raise ValueError(f"exit {done.returncode}: {last}")
        got = parse(done.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:  # json's errors are ValueErrors
        rec["skipped"] = f"failed: {type(e).__name__}: {str(e).strip()[:200]}"
        return rec
    rec.update(peer=got["version"], tokens=gen_len, ms_per_token=got["ms_per_token"], tokens_per_verification=1.0,
               decode_s=got["ms_per_token"] * gen_len / 1000, weights=got["weights"], threads=got["threads"],
               command=" ".join(cmd))
    return rec
