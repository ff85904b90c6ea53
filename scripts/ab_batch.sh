#!/usr/bin/env bash
# Two commits side by side on batches: `tforce bench --batch` from a worktree of each, alternating, REPS times,
# one JSON report per run under $OUT; then per commit and method the median speed-up of the batch over the
# same prompts one at a time (its range), the median tokens/s of each, and whether every row equalled its
# prompt alone in every run.
#   OUT=ab-batch REPS=5 bash scripts/ab_batch.sh OLD_COMMIT NEW_COMMIT
# Each commit runs with this checkout's virtualenv and its own package (PYTHONPATH).
set -u
OLD=$1 NEW=$2
OUT=${OUT:-ab-batch}
REPS=${REPS:-5}
PY=${PY:-$PWD/.venv/bin/python}
ARGS=${ARGS:-"-m models/demo-target --draft models/demo-draft --batch 8 --prompt-len 1000 --gen-len 128 \
--methods ar,triforce,naive --temperature 0 --budget 256 --threads 1 --prompt-file tforce/data/demo_excerpt.txt"}
mkdir -p "$OUT"
for c in "$OLD" "$NEW"; do
  [ -d "$OUT/wt-$c" ] || git worktree add --detach "$OUT/wt-$c" "$c" >/dev/null
done
for rep in $(seq 1 "$REPS"); do
  for c in "$OLD" "$NEW"; do
    echo "== $c r$rep $(date -u +%H:%M:%S) load$(uptime | sed 's/.*average://')" >&2
    # shellcheck disable=SC2086
    (cd "$OUT/wt-$c" && PYTHONPATH=$PWD $PY -m tforce bench $ARGS --json >"../$c-r$rep.json" 2>"../$c-r$rep.log") \
      || echo "failed: $c r$rep" >&2
  done
done
$PY - "$OUT" "$OLD" "$NEW" <<'PY'
import json, statistics, sys
from pathlib import Path
out, commits = Path(sys.argv[1]), sys.argv[2:]
print("| commit | method | speed-up (range) | batch / one at a time tokens/s | rows equal alone | runs |")
print("|---|---|---|---|---|---|")
for commit in commits:
    cells = {}
    for f in sorted(out.glob(f"{commit}-r*.json")):
        for run in json.loads(f.read_text())["runs"]:
            cells.setdefault(run["method"], []).append(run)
    for method, runs in cells.items():
        s = [r["speedup_vs_one_at_a_time"] for r in runs]
        batch = statistics.median(r["batch_tokens_per_s"] for r in runs)
        alone = statistics.median(r["one_at_a_time_tokens_per_s"] for r in runs)
        equal = all(r["rows_equal_alone"] for r in runs)
        print(f"| {commit} | {method} | {statistics.median(s):.2f}x [{min(s):.2f}-{max(s):.2f}] | "
              f"{batch:.0f} / {alone:.0f} | {equal} | {len(runs)} |")
PY
for c in "$OLD" "$NEW"; do git worktree remove --force "$OUT/wt-$c"; done
