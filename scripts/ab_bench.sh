#!/usr/bin/env bash
# Two commits side by side: `tforce bench` from a worktree of each, alternating, REPS times, one JSON report
# per run under $OUT; then a table of the median ms/token per method, prompt length and commit.
#   OUT=ab-out REPS=5 bash scripts/ab_bench.sh OLD_COMMIT NEW_COMMIT
# Each commit runs with this checkout's virtualenv and its own package (PYTHONPATH).
set -u
OLD=$1 NEW=$2
OUT=${OUT:-ab-out}
REPS=${REPS:-5}
LENS=${LENS:-"1000 3300"}
METHODS=${METHODS:-ar,triforce}
PY=${PY:-$PWD/.venv/bin/python}
ARGS=${ARGS:-"-m models/demo-target --draft models/demo-draft --gen-len 64 --temperature 0 --budget 256 --draft-budget 192 --prompt-file tforce/data/demo_excerpt.txt"}
mkdir -p "$OUT"
for c in "$OLD" "$NEW"; do
  [ -d "$OUT/wt-$c" ] || git worktree add --detach "$OUT/wt-$c" "$c" >/dev/null
done
for rep in $(seq 1 "$REPS"); do
  for len in $LENS; do
    for c in "$OLD" "$NEW"; do
      echo "== $c $len r$rep" >&2
      (cd "$OUT/wt-$c" && PYTHONPATH=$PWD $PY -m tforce bench $ARGS --prompt-len "$len" --methods "$METHODS" \
        --json >"../$c-$len-r$rep.json" 2>"../$c-$len-r$rep.log") || echo "failed: $c $len r$rep" >&2
    done
  done
done
$PY - "$OUT" "$OLD" "$NEW" <<'PY'
import json, statistics, sys
from pathlib import Path
out, old, new = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
cells = {}
for f in out.glob("*.json"):
    commit, length, _ = f.stem.rsplit("-", 2)
    for run in json.loads(f.read_text())["runs"]:
        cells.setdefault((run["method"], int(length), commit), []).append(run["ms_per_token"])
print("| method | prompt tokens | " + old + " ms/token | " + new + " ms/token | new / old | runs |")
print("|---|---|---|---|---|---|")
for method, length in sorted({(m, n) for m, n, _ in cells}):
    a, b = (statistics.median(cells[(method, length, c)]) for c in (old, new))
    print(f"| {method} | {length} | {a:.2f} | {b:.2f} | {b / a:.3f} | {len(cells[(method, length, new)])} |")
PY
for c in "$OLD" "$NEW"; do git worktree remove --force "$OUT/wt-$c"; done
