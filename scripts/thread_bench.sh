#!/usr/bin/env bash
# CPU threading side by side: tforce `ar`/`triforce` and transformers' greedy/assisted `generate`
# (`tforce bench --peers hf`, in the same process) for each threading setting, on a quiet machine and
# beside N busy-looping processes (LOADS: 0, 1, 2; T: one that is busy 3 s, idle 3 s, over and over),
# REPS times each (settings alternate within a repeat). One JSON report per cell under $OUT;
# scripts/thread_table.py tabulates the medians.
#   OUT=thread-out LOADS="0 1 2 T" REPS=3 bash scripts/thread_bench.sh
# The methods side by side, as tforce chooses threads (issue of the default method):
#   OUT=method-out SETTINGS=auto METHODS=auto,ar,naive,retrieval,streaming,triforce bash scripts/thread_bench.sh
# Settings: auto (nothing set: what tforce chooses, tforce/threads.py), POLICY-tN: OMP_WAIT_POLICY=POLICY
# (PASSIVE: sleeping OpenMP workers, ACTIVE: spinning ones, default: unset) and --threads N.
set -u
OUT=${OUT:-thread-out}
MODELS=${MODELS:-"models/demo-target:3300:64 smollm2-135m-instruct:1000:32"}  # name:prompt tokens:new tokens
LOADS=${LOADS:-"0 1 2"}
SETTINGS=${SETTINGS:-"auto default-t2 default-t1 PASSIVE-t2"}
METHODS=${METHODS:-ar,triforce}
REPS=${REPS:-3}
BOOK=${BOOK:-../shared/data/books/middlemarch.txt}
TFORCE=${TFORCE:-.venv/bin/tforce}
CELL_S=${CELL_S:-600}
mkdir -p "$OUT"
for load in $LOADS; do
  pids=()
  if [ "$load" = T ]; then
    python3 -c 'import time
while True:
    end = time.time() + 3
    while time.time() < end: pass
    time.sleep(3)' & pids+=($!)
  else
    for _ in $(seq 1 "$load"); do python3 -c 'while True: pass' & pids+=($!); done
  fi
  sleep 2
  for rep in $(seq 1 "$REPS"); do
    for spec in $MODELS; do
      IFS=: read -r model plen glen <<<"$spec"
      for setting in $SETTINGS; do
        name="$(basename "$model")-$plen-load$load-$setting-r$rep"
        env_args=() threads=0
        if [ "$setting" != auto ]; then
          policy=${setting%-t*} threads=${setting##*-t}
          [ "$policy" != default ] && env_args=(OMP_WAIT_POLICY="$policy")
        fi
        echo "== $name" >&2
        env -u OMP_WAIT_POLICY "${env_args[@]}" timeout "$CELL_S" "$TFORCE" bench -m "$model" \
          --prompt-file "$BOOK" --prompt-len "$plen" --gen-len "$glen" --methods "$METHODS" \
          --peers hf --temperature 0 --threads "$threads" --json >"$OUT/$name.json" 2>"$OUT/$name.log" \
          || echo "failed: $name (see $OUT/$name.log)" >&2
      done
    done
  done
  [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}"
  wait 2>/dev/null
done
