#!/usr/bin/env bash
# One command for a GPU machine: versions, the CUDA tests, the CPU suite, a short synthetic benchmark.
#
#   bash scripts/gpu_check.sh            # from the repository root; results in $OUT (default ./out)
#
# Installs nothing: the package runs from the checkout (PYTHONPATH=.); python3 must already have torch
# (CUDA build), transformers and tforce's other dependencies. Every step logs to <step>.log in a work
# folder that is packed into $OUT/gpu_check.tgz after each step (the device tool brings back at most 8
# files, and a run cut short by its time limit still leaves the steps done so far); the benches' tables
# with their floors go to $OUT/gpu_check_summary.md (scripts/bench_summary.py). The
# script goes on after a failed step and exits 1 if any failed. The benchmark uses RANDOM weights
# (--synthetic llama2-7b): its speeds are real, its acceptance rates say nothing about trained models.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT  # everything kept is packed into $OUT
pack() { tar czf "$OUT/gpu_check.tgz" -C "$WORK" . ; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
PROMPT_LEN="${PROMPT_LEN:-8192}"
GEN_LEN="${GEN_LEN:-64}"
failed=()

step() {  # step NAME COMMAND...: run, tee to $WORK/NAME.log, remember failures, pack
    local name="$1"; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$WORK/$name.log"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed+=("$name")
    pack
}

step versions "$PY" - <<'PY'
import importlib, platform, subprocess
import torch
print("python", platform.python_version())
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
missing = []
for name in ("transformers", "tokenizers", "safetensors", "typer", "rich", "psutil", "pytest", "xdist", "flash_attn"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except ImportError:
        print(name, "MISSING")
        missing.append(name)
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip())
except Exception as e:
    print("nvidia-smi:", type(e).__name__)
need = {"transformers", "tokenizers", "safetensors", "typer", "rich", "psutil", "pytest"}
if need & set(missing) or not torch.cuda.is_available():
    raise SystemExit(f"cannot go on: missing {sorted(need & set(missing))}, CUDA {torch.cuda.is_available()}")
PY
if [ "${#failed[@]}" -ne 0 ]; then
    echo "gpu_check: the environment lacks what the checks need (see versions.log in $OUT/gpu_check.tgz)"
    exit 1
fi

# SKIP_TESTS=1 skips the CUDA tests (for a second call on a machine where they already ran). Each long step
# has a limit of its own (CUDA_TESTS_S, PROBE_S, BENCH_S seconds) below the device call's 600: a step cut by
# the call's limit would bring back nothing of its log (logs are packed when a step ends).
[ "${SKIP_TESTS:-0}" = 1 ] || step cuda_tests timeout "${CUDA_TESTS_S:-420}" "$PY" -m pytest -q -m cuda -rs \
    -p no:cacheprovider
# Does SDPA (the path without flash-attn) materialise scores? The planner assumes it does.
step sdpa_probe timeout "${PROBE_S:-120}" "$PY" scripts/gpu_sdpa_probe.py

step info "$PY" -m tforce info --synthetic llama2-7b --context 131072 --json
cp "$WORK/info.log" "$WORK/info.json" 2>/dev/null
# The RTX 4090 plan (issue 13): every device allocation itemised, prefill and decode peaks under 24 GiB.
step info_24gib "$PY" -m tforce info --synthetic llama2-7b --gpu-memory 24GiB --context 131072
for mode in off on; do
    name="bench_llama2-7b_${PROMPT_LEN}_offload_${mode}"
    echo "== $name"
    t0=$SECONDS
    timeout "${BENCH_S:-300}" "$PY" -m tforce bench --synthetic llama2-7b --device cuda --prompt-len "$PROMPT_LEN" \
        --gen-len "$GEN_LEN" --offload "$mode" --record "$WORK/$name.json" >"$WORK/$name.log" 2>&1
    rc=$?
    tail -n 20 "$WORK/$name.log"
    "$PY" scripts/bench_summary.py "$WORK/$name.json" || { [ "$rc" -ne 0 ] || rc=1; }  # keeps a limit's 124
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed+=("$name")
    "$PY" scripts/bench_summary.py "$WORK"/bench_*.json >"$OUT/gpu_check_summary.md"
    pack
done

# Only with CPU_SUITE=1 (it ran on the first H100 call, 2026-11-23, and costs minutes of device time):
# the CPU suite (what CI runs) under this machine's torch and transformers, time-boxed, with the GPU
# hidden, since its tests compare against CPU defaults. Tests needing ../shared fail here.
if "$PY" -c "import xdist" 2>/dev/null; then par=(-n 8); else par=(); fi
[ "${CPU_SUITE:-0}" = 1 ] && CUDA_VISIBLE_DEVICES="" step cpu_suite timeout "${CPU_SUITE_S:-240}" "$PY" -m pytest \
    -q -m "not cuda" -p no:cacheprovider "${par[@]}"

if [ "${#failed[@]}" -ne 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]} (logs in $OUT/gpu_check.tgz)"
    exit 1
fi
echo "gpu_check: all steps passed (logs in $OUT/gpu_check.tgz)"
