#!/usr/bin/env bash
# The paper's setting on synthetic Llama-2-7B-128K weights (GPU work queue, item b), one bench per
# (prompt length, placement, temperature), each time-boxed. The JSON and logs are packed into
# $OUT/gpu_paper.tgz after every bench (at most 8 files come back from the device tool, and a call cut
# short by its limit keeps what finished); $OUT/gpu_paper_summary.md tabulates every figure beside its
# floor and the projection at acceptance 0.92 (scripts/bench_summary.py). Each bench's JSON is written after
# every method (--record), so a bench cut by BENCH_S keeps the methods that finished.
#
#   PROMPT_LENS="32768 122880" PLACEMENTS="on 24GiB off" TEMPS="0 0.6" GEN_LEN=64 bash scripts/gpu_paper.sh
#
# EXTRA adds bench options (e.g. EXTRA="--prefill-chunk 4096"). SYNTH and DEVICE override the architecture and device (SYNTH=tiny DEVICE=cpu checks the script on a CPU).
# Placements: on = KV fully offloaded to pinned host memory; 24GiB = --gpu-memory 24GiB --offload auto
# (an RTX 4090's budget); off = on chip. Random weights: times are real, acceptance is meaningless.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT  # everything kept is packed into $OUT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
METHODS="${METHODS:-ar,triforce,naive,retrieval,streaming}"
failed=()
for n in ${PROMPT_LENS:-32768}; do
  for p in ${PLACEMENTS:-on}; do
    case "$p" in
      on|off) place=(--offload "$p") ;;
      *) place=(--offload auto --gpu-memory "$p") ;;
    esac
    for t in ${TEMPS:-0}; do
      name="paper_${n}_${p}_t${t}"
      echo "== $name"
      t0=$SECONDS
      timeout "${BENCH_S:-300}" "$PY" -m tforce bench --synthetic "${SYNTH:-llama2-7b}" --device "${DEVICE:-cuda}" \
          --prompt-len "$n" \
          --gen-len "${GEN_LEN:-64}" --methods "$METHODS" -t "$t" "${place[@]}" ${EXTRA:-} \
          --record "$WORK/$name.json" >"$WORK/$name.log" 2>&1
      rc=$?
      tail -n 12 "$WORK/$name.log"
      "$PY" scripts/bench_summary.py "$WORK/$name.json" || { [ "$rc" -ne 0 ] || rc=1; }  # keeps a limit's 124
      echo "== $name: exit $rc after $((SECONDS - t0)) s"
      [ "$rc" -eq 0 ] || failed+=("$name")
      "$PY" scripts/bench_summary.py "$WORK"/paper_*.json >"$OUT/gpu_paper_summary.md"
      tar czf "$OUT/gpu_paper.tgz" -C "$WORK" .
    done
  done
done
[ "${#failed[@]}" -eq 0 ] || { echo "gpu_paper: FAILED: ${failed[*]}"; exit 1; }
