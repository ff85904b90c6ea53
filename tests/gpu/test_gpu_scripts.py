"""The GPU scripts' output contract (the device tool brings back at most 8 files from $OUT, also from a call
cut short by its time limit), checked on the CPU with a stand-in python that hangs after the first step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stand_in(tmp_path, script: str) -> Path:
    """An executable `python` in tmp_path running the shell `script` (a stand-in for the GPU machine's)."""
    fake = tmp_path / "python"
    fake.write_text(script)
    fake.chmod(0o755)
    return fake


def run_until(script: str, env: dict, marker: str, limit: float) -> list[str]:
    """Run scripts/SCRIPT, read its output until a line starts with `marker`, then kill it (and its steps)
    as the device tool kills a call past its limit; the lines seen. `limit` seconds at most: never a hung test."""
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    guard = threading.Timer(limit, os.killpg, (proc.pid, signal.SIGKILL))
    guard.start()
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(marker):
                break
    finally:
        guard.cancel()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return seen


def test_gpu_features_cut_short_still_brings_back_its_steps(tmp_path):
    # The versions step runs (real python, `python -`); every later one hangs, and the call is killed
    # there, as the device tool kills one past its limit: what was done must already be in one file.
    fake = stand_in(tmp_path, f'#!/bin/sh\n[ "$1" = "-" ] && exec "{sys.executable}" "$@"\nexec sleep 60\n')
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), DEVICE="cpu", TMPDIR=str(tmp_path))
    run_until("gpu_features.sh", env, "== cuda_tests (limit", 60)  # the versions step is done, the next hangs
    assert sorted(p.name for p in out.iterdir()) == ["gpu_features.tgz"]
    with tarfile.open(out / "gpu_features.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        steps = tar.extractfile("./steps.txt").read().decode()
    assert {"versions.log", "steps.txt"} <= names
    assert steps.startswith("versions exit 0")


def test_gpu_features_summary_marks_a_bench_cut_short(tmp_path):
    """A bench record a limit cut short ("complete": false) read in gpu_features' figures like a whole one;
    they now say "CUT SHORT", as scripts/bench_summary.py does. The stand-in python runs `python -` (the
    versions and figures steps) for real, writes a bench record for each `-m tforce bench`, cut short for
    peers_hf only, and passes every other step."""
    fake = stand_in(tmp_path, f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
if args[:1] == ["-"]:
    os.execv({sys.executable!r}, [{sys.executable!r}, *args])
if args[:3] == ["-m", "tforce", "bench"]:
    path = args[args.index("--record") + 1]
    cut = os.path.basename(path) == "peers_hf.json"
    run = dict(method="ar", ms_per_token=1.0, speedup_vs_ar=1.0, tokens_per_verification=1.0, prefill_s=0.1)
    record = dict(device="cpu", dtype="float32", prompt_tokens=200, gen_len=8, methods=["ar", "triforce"],
                  complete=not cut, runs=[run] if cut else [run, dict(run, method="triforce")])
    open(path, "w").write(json.dumps(record))
""")
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), DEVICE="cpu", TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_features.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    heads = {line.split(":")[0]: line for line in lines if "prompt tokens" in line}  # one per bench record
    assert heads["peers_hf"].endswith(" — CUT SHORT: 1 of 2 methods finished"), heads
    assert "CUT SHORT" not in heads["batch1_chip"] and len(heads) == 11, heads  # weights_auto, weights_int4 among them


def test_gpu_paper_in_its_cpu_mode_records_and_summarises(tmp_path):
    """SYNTH=tiny DEVICE=cpu: the bench's record (written with --record) and the summary come back."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, SYNTH="tiny", DEVICE="cpu", PROMPT_LENS="200",
               PLACEMENTS="on", GEN_LEN="4", METHODS="ar,retrieval", BENCH_S="120", TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_paper.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_paper.tgz", "gpu_paper_summary.md"]
    summary = (out / "gpu_paper_summary.md").read_text()
    assert "`paper_200_on_t0.json`" in summary and "| retrieval |" in summary and "CUT SHORT" not in summary


def test_sdpa_probe_restricts_attend_itself_to_the_efficient_backend(monkeypatch):
    # attend() enters sdpa_kernel(attention._CUDA_BACKENDS) on CUDA, which replaces the backends an outer
    # sdpa_kernel allowed: the probe's "efficient backend alone accepts" check must restrict that list,
    # else attend() always finds MATH and the check can never say no.
    import importlib.util

    from torch.nn.attention import SDPBackend

    from tforce.model import attention

    spec = importlib.util.spec_from_file_location("gpu_sdpa_probe", ROOT / "scripts" / "gpu_sdpa_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    seen = []

    def fake_attend(q, view, use_flash=True):
        seen.append(list(attention._CUDA_BACKENDS))
        if SDPBackend.EFFICIENT_ATTENTION not in attention._CUDA_BACKENDS or len(attention._CUDA_BACKENDS) > 1:
            return None  # MATH (or another backend) would take the call: no error
        raise RuntimeError("No available kernel")  # the efficient backend alone refuses this input

    monkeypatch.setattr(probe, "attend", fake_attend)
    assert probe.efficient_alone(None, None) is False
    assert seen == [[SDPBackend.EFFICIENT_ATTENTION]]
    assert attention._CUDA_BACKENDS[0] == SDPBackend.FLASH_ATTENTION  # restored


def test_gpu_check_bounds_its_cuda_tests_and_brings_back_their_log(tmp_path):
    # The CUDA tests step had no limit of its own: past the device call's limit the whole call is killed, and
    # its log (kept in a work folder that is packed only after a step ends) never came back. The stand-in
    # python passes the versions step and hangs in every later one.
    fake = stand_in(tmp_path, '#!/bin/sh\nif [ "$1" = "-" ]; then cat >/dev/null; echo "torch stand-in"; exit 0; fi\n'
                              'echo "stand-in started: $*"\nexec sleep 60\n')
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), CUDA_TESTS_S="2", TMPDIR=str(tmp_path))
    seen = run_until("gpu_check.sh", env, "== sdpa_probe", 30)  # the CUDA tests step has ended
    assert any(line.startswith("== cuda_tests: exit 124") for line in seen), "".join(seen)
    with tarfile.open(out / "gpu_check.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        log = tar.extractfile("./cuda_tests.log").read().decode()
    assert {"versions.log", "cuda_tests.log"} <= names and "stand-in started: -m pytest" in log


def test_sdpa_probe_lower_right_candidate_is_attend_on_the_cpu():
    """The probe's causal_lower_right form (item c's candidate) computes what attend() does for a plain
    causal view (checked here in float32 on the CPU, MHA and GQA, one and several queries), so its GPU
    timings compare like with like."""
    import importlib.util

    import torch

    from tforce.model.attention import attend
    from tforce.cache.base import CacheView

    spec = importlib.util.spec_from_file_location("gpu_sdpa_probe", ROOT / "scripts" / "gpu_sdpa_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    gen = torch.Generator().manual_seed(0)
    for h_q, h_kv in ((4, 4), (8, 2)):
        for T, S in ((1, 33), (5, 40), (16, 16)):
            k, v = torch.randn(2, 1, S, h_kv, 16, generator=gen)
            q = torch.randn(1, T, h_q, 16, generator=gen)
            mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None]
            view = CacheView(k, v, mask, causal=True)
            torch.testing.assert_close(probe.lower_right(q, view), attend(q, view), rtol=1e-5, atol=1e-6)
            shifted = CacheView(k, v, torch.ones(T, S, dtype=torch.bool).tril(S - T - 1)[None], causal=True)
            if T > 1:  # a top-left or off-by-one alignment would not match
                assert not torch.allclose(probe.lower_right(q, view), attend(q, shifted), atol=1e-4)


def test_gpu_paper_says_a_bench_was_killed_by_its_limit(tmp_path):
    """A bench killed by BENCH_S before its first method ends leaves no record, so the summary of it fails
    too: the step must still read exit 124 (its limit), not the summary's 1."""
    fake = stand_in(tmp_path, f'#!/bin/sh\n[ "$1" = "-m" ] && exec sleep 60\nexec "{sys.executable}" "$@"\n')
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), PROMPT_LENS="200", PLACEMENTS="on", BENCH_S="1",
               TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_paper.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "gpu_paper: FAILED: paper_200_on_t0" in done.stdout, done.stdout + done.stderr
    assert "== paper_200_on_t0: exit 124 after" in done.stdout, done.stdout


def test_bench_chat_puts_transformers_prefix_cache_beside_tforce(tmp_path):
    """gpu_features.sh's chat step with --peers hf: transformers' documented prefix-cache reuse (a DynamicCache
    deep-copied per question) timed on the same weights, its greedy answer equal to tforce's."""
    out = tmp_path / "chat.json"
    r = subprocess.run([sys.executable, "scripts/bench_chat.py", "tforce/data/demo_excerpt.txt", "200", "ar", "1",
                        "--synthetic", "tiny", "--peers", "hf", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    hf = json.loads(out.read_text())["hf"]
    assert hf["vs_tforce"] == "match" and hf["ttft_cold_s"] > 0 and hf["ttft_warm_s"] > 0
    assert "transformers" in r.stdout and "answer vs tforce's: match" in r.stdout
