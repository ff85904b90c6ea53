#!/usr/bin/env bash
# One call for the features that had never run on CUDA: batches, KV snapshots, chat, --peers hf, --deterministic,
# quantized projections (int4, int8).
#
#   bash scripts/gpu_features.sh            # from the repository root; OUT=./out by default
#
# Steps, in order of importance (so a cut run still brings back the first ones): the CUDA tests of those
# paths (tests/gpu/test_cuda.py -k features, --peers hf's in tests/bench/test_peers.py, tests/model/test_quant_cuda.py),
# then short figures on RANDOM llama2-7b weights in bfloat16 (times are real, acceptance rates
# meaningless): decode with the projections int4 (--weights int4) beside bfloat16 (on chip), `tforce bench
# --batch N` for N = 1, 4, 8 (ar and triforce, on chip), the time to first token of a second question with
# and without the document's KV kept or loaded from a snapshot (scripts/bench_chat.py), `--peers hf` beside
# ar, --deterministic (+det) beside the plain methods on chip and offloaded, and last the batches with the
# KV cache offloaded. Every bench records torch.cuda.max_memory_reserved (gpu_reserved_gib) beside the
# plan's predicted peak (planned_peak_gib).
#
# SKIP names steps to leave out (shell globs), e.g. SKIP="cuda_tests batch?_chip chat_*" after a call that ran them.
# Time: the script starts no step after DEADLINE_S seconds (default 460) and cuts each at its own limit, so it
# ends inside one 10-minute call. Output: at most 8 files come back from a device call's $OUT, so logs and
# JSON go to a work folder that is packed into $OUT/gpu_features.tgz after every step (a call cut short
# by its limit still brings back the steps done); at the end $OUT/summary.txt holds each step's exit status
# and seconds and the figures read from the JSON (a bench record cut short marked "CUT SHORT", by
# scripts/bench_summary.py's rule), and $OUT/cuda_tests.log is the tests' log.
# Installs nothing (PYTHONPATH=.). DEVICE=cpu SYNTH=tiny PROMPT_LEN=200 GEN_LEN=8 BUDGET=64 DRAFT_BUDGET=32
# runs the same command lines on a CPU, to check that they parse and write their JSON.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
LOGS="$(mktemp -d)"  # logs and JSON, packed into $OUT/gpu_features.tgz after every step
trap 'rm -rf "$LOGS"' EXIT
pack() { tar czf "$OUT/gpu_features.tgz" -C "$LOGS" . ; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
SYNTH="${SYNTH:-llama2-7b}"
# The quantized projections' step: tiny's 172-wide MLP takes no int4 (nor int8), so the CPU check runs the
# same command line with float
QUANT="${QUANT:-$([ "$SYNTH" = tiny ] && echo float || echo int4)}"
PROMPT_LEN="${PROMPT_LEN:-2048}"
GEN_LEN="${GEN_LEN:-32}"
BUDGET="${BUDGET:-256}"  # the middle level's cache: an eighth of the prompt (the paper: 4K of 128K)
DRAFT_BUDGET="${DRAFT_BUDGET:-128}"
DEADLINE_S="${DEADLINE_S:-460}"
SUMMARY="$LOGS/steps.txt"
: >"$SUMMARY"
failed=()

start() {  # start NAME WANTED_S: LIMIT = the seconds the step may take within the deadline; false past it
    local pattern
    for pattern in ${SKIP:-}; do  # SKIP="cuda_tests batch?_chip chat_*": steps a previous call ran
        # shellcheck disable=SC2053  # a glob on purpose
        if [[ "$1" == $pattern ]]; then
            echo "== $1: skipped (SKIP)"
            echo "$1 skipped (SKIP)" >>"$SUMMARY"
            return 1
        fi
    done
    local left=$((DEADLINE_S - SECONDS))
    LIMIT=$(($2 < left ? $2 : left))
    if [ "$left" -lt 30 ]; then
        echo "== $1: not started (deadline)"
        echo "$1 not started (deadline)" >>"$SUMMARY"
        return 1
    fi
}

finish() {  # finish NAME RC T0: record a step's outcome
    echo "== $1: exit $2 after $((SECONDS - $3)) s"
    echo "$1 exit $2 $((SECONDS - $3)) s" >>"$SUMMARY"
    [ "$2" -eq 0 ] || failed+=("$1")
    pack
}

step() {  # step NAME LIMIT_S COMMAND...: stdout and stderr to $LOGS/NAME.log (and here)
    local name="$1"
    start "$name" "$2" || return 0
    shift 2
    echo "== $name (limit $LIMIT s): $*"
    local t0=$SECONDS
    timeout "$LIMIT" "$@" 2>&1 | tee "$LOGS/$name.log"
    finish "$name" $? "$t0"
}

bench() {  # bench NAME LIMIT_S OPTIONS...: tforce bench --record $LOGS/NAME.json (written after every method), output to NAME.log
    local name="$1"
    start "$name" "$2" || return 0
    shift 2
    local cmd=("$PY" -m tforce bench --synthetic "$SYNTH" --device "$DEVICE" --prompt-len "$PROMPT_LEN"
               --gen-len "$GEN_LEN" --budget "$BUDGET" --draft-budget "$DRAFT_BUDGET" --temperature 0 "$@"
               --record "$LOGS/$name.json")
    echo "== $name (limit $LIMIT s): ${cmd[*]}"
    local t0=$SECONDS
    timeout "$LIMIT" "${cmd[@]}" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 5 "$LOGS/$name.log"
    finish "$name" "$rc" "$t0"
}

step versions 60 "$PY" - "$DEVICE" <<'PY'
import importlib, platform, subprocess, sys
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
for name in ("transformers", "tokenizers", "safetensors", "typer", "rich", "psutil", "pytest", "flash_attn"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except ImportError:
        print(name, "MISSING")
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip())
except Exception as e:
    print("nvidia-smi:", type(e).__name__)
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    raise SystemExit("no CUDA device")
PY
[ "${#failed[@]}" -eq 0 ] || DEADLINE_S=0  # no CUDA or no torch: start nothing else

step cuda_tests 210 "$PY" -m pytest -q -rs -p no:cacheprovider --durations=15 -m cuda \
    -k "features or peers_on_cuda or quant_cuda" tests/gpu/test_cuda.py tests/bench/test_peers.py tests/model/test_quant_cuda.py

for weights in auto "$QUANT"; do  # auto: the dtype's own projections (bfloat16 on CUDA)
    bench "weights_${weights}" 60 --methods ar,triforce --offload off --weights "$weights"
done

for n in 1 4 8; do
    bench "batch${n}_chip" 75 --batch "$n" --methods ar,triforce --offload off
done
for method in triforce ar; do
    peers=(); [ "$method" = ar ] && peers=(--peers hf)  # transformers' prefix cache beside plain decoding
    step "chat_${method}" 75 "$PY" scripts/bench_chat.py tforce/data/demo_excerpt.txt "$PROMPT_LEN" "$method" 3 \
        --synthetic "$SYNTH" --device "$DEVICE" --budget "$BUDGET" --draft-budget "$DRAFT_BUDGET" \
        --json "$LOGS/chat_${method}.json" ${peers[@]+"${peers[@]}"}
done
bench peers_hf 75 --methods ar --peers hf --offload off
for mode in off on; do
    bench "deterministic_offload_${mode}" 75 --methods ar,triforce,triforce+det,retrieval,retrieval+det \
        --offload "$mode"
done
for n in 1 4 8; do
    bench "batch${n}_host" 90 --batch "$n" --methods ar,triforce --offload on
done

# The figures, one line per run, from every JSON written (a cut or failed step has none or an empty one).
"$PY" - "$LOGS" >"$LOGS/figures.txt" <<'PY'
import json, sys
from pathlib import Path

sys.path.insert(0, "scripts")  # the script runs from the repository root
from bench_summary import cut_short  # a record a limit cut short says so, as in gpu_paper's summary

def f(x, fmt=".2f"):
    return "-" if x is None else format(x, fmt)

def memory(r):
    return (f"GPU GiB allocated {f(r.get('gpu_mem_gib'))} reserved {f(r.get('gpu_reserved_gib'))} "
            f"planned {f(r.get('planned_peak_gib'))}")

for path in sorted(Path(sys.argv[1]).glob("*.json")):
    try:
        r = json.loads(path.read_text())
    except ValueError:
        print(f"{path.stem}: no JSON")
        continue
    if "ttft_cold_s" in r:  # bench_chat.py
        print(f"{path.stem}: {r['document_tokens']} tokens, time to first token cold {f(r['ttft_cold_s'], '.3f')} s, "
              f"warm {f(r['ttft_warm_s'], '.3f')} s; document prefill {f(r['document_prefill_s'], '.3f')} s, "
              f"snapshot load {f(r['snapshot_load_s'], '.3f')} s ({f(r['snapshot_mib'], '.0f')} MiB)")
        if r.get("hf"):
            h = r["hf"]
            print(f"  transformers {h['transformers']}: time to first token cold {f(h['ttft_cold_s'], '.3f')} s, "
                  f"warm {f(h['ttft_warm_s'], '.3f')} s (prefix cache deep-copied); answer vs tforce: {h['vs_tforce']}")
        continue
    cut = cut_short(r)
    print(f"{path.stem}: {r['device']}, {r['dtype']}, {r['prompt_tokens']} prompt tokens, {r['gen_len']} new"
          + (f" — {cut}" if cut else ""))
    for run in r["runs"]:
        if "batch_tokens_per_s" in run:
            print(f"  {run['method']}: batch {f(run['batch_tokens_per_s'], '.1f')} tok/s, one at a time "
                  f"{f(run['one_at_a_time_tokens_per_s'], '.1f')} tok/s, x{f(run['speedup_vs_one_at_a_time'])}, "
                  f"rows equal alone {run['rows_equal_alone']}; {memory(run)}")
        else:
            print(f"  {run['method']}: {f(run['ms_per_token'], '.1f')} ms/token, x{f(run['speedup_vs_ar'])} vs ar, "
                  f"tokens/verif {f(run['tokens_per_verification'])}, prefill {f(run['prefill_s'])} s; {memory(run)}")
    for peer in r.get("peers", []):
        print(f"  {peer['method']}: {f(peer['ms_per_token'], '.1f')} ms/token, x{f(peer['speedup_vs_ar'])} vs ar, "
              f"tokens vs ar {peer['vs_ar']}, skipped {peer['skipped']}")
PY
cat "$SUMMARY" "$LOGS/figures.txt" | tee "$OUT/summary.txt"
[ -f "$LOGS/cuda_tests.log" ] && cp "$LOGS/cuda_tests.log" "$OUT/cuda_tests.log"
pack && rm -rf "$LOGS"
if [ "${#failed[@]}" -ne 0 ]; then
    echo "gpu_features: FAILED: ${failed[*]} (logs in $OUT/gpu_features.tgz)" | tee -a "$OUT/summary.txt"
    exit 1
fi
echo "gpu_features: every step that started passed ($SECONDS s; logs in $OUT/gpu_features.tgz)" \
    | tee -a "$OUT/summary.txt"
