#!/usr/bin/env bash
# GPU work queue item d: train the long-context demo pair with scripts/train_demo.py's `gpu` configuration
# in one device call, and bring it back through the device tool's $OUT (at most 8 files of 16 MiB).
#
#   make gpu-data BOOKS=path/to/books               # here: packs a folder of plain-text books into gpu_data/books.tgz
#   run(command="bash scripts/gpu_train.sh", carry=["gpu_data"], timeout_s=600)
#   cat FILES_AT/gpu_pair.tar.part-* | tar xf - -C /tmp/pair   # here: models/, train.log
#
# MINUTES (default 6) is the training budget; the tokenizer, the held-out perplexity and the passkey
# evaluation come on top, and the whole call must end within the tool's 10 minutes. CONFIG=tiny and
# DEVICE=cpu check the script on a CPU. The pair and its log are packed into 15 MiB parts.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT  # everything kept is packed into $OUT
BOOKS_TGZ="${BOOKS_TGZ:-gpu_data/books.tgz}"
[ -f "$BOOKS_TGZ" ] || { echo "gpu_train: no $BOOKS_TGZ (run 'make gpu-data' and carry gpu_data)"; exit 2; }
mkdir -p "$WORK/books" "$WORK/pair"
tar xzf "$BOOKS_TGZ" -C "$WORK/books"
"$PY" scripts/train_demo.py --config "${CONFIG:-gpu}" --minutes "${MINUTES:-6}" --books "$WORK/books" \
    --out "$WORK/pair/models" --device "${DEVICE:-cuda}" --threads "${THREADS:-8}" 2>&1 | tee "$WORK/pair/train.log"
rc=$?
tar cf - -C "$WORK/pair" . | split -b 15m -d - "$OUT/gpu_pair.tar.part-"
cp "$WORK/pair/models/README.md" "$OUT/card.md" 2>/dev/null
ls -la "$OUT"
echo "gpu_train: exit $rc"
exit "$rc"
