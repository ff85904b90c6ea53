#!/usr/bin/env bash
# The paper's setting on synthetic Llama-2-7B-128K weights (GPU work queue, item b), one bench per
# (prompt length, placement, temperature), each time-boxed; JSON and logs under $OUT.
#
#   PROMPT_LENS="32768 122880" PLACEMENTS="on 24GiB off" TEMPS="0 0.6" GEN_LEN=64 bash scripts/gpu_paper.sh
#
# Placements: on = KV fully offloaded to pinned host memory; 24GiB = --gpu-memory 24GiB --offload auto
# (an RTX 4090's budget); off = on chip. Random weights: times are real, acceptance is meaningless.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
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
      timeout "${BENCH_S:-300}" "$PY" -m tforce bench --synthetic llama2-7b --device cuda --prompt-len "$n" \
          --gen-len "${GEN_LEN:-64}" --methods "$METHODS" -t "$t" "${place[@]}" --json \
          >"$OUT/$name.json" 2>"$OUT/$name.log"
      rc=$?
      tail -n 40 "$OUT/$name.log"
      echo "== $name: exit $rc after $((SECONDS - t0)) s"
      [ "$rc" -eq 0 ] || failed+=("$name")
    done
  done
done
[ "${#failed[@]}" -eq 0 ] || { echo "gpu_paper: FAILED: ${failed[*]}"; exit 1; }
