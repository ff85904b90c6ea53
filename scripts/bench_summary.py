"""Markdown tables from `tforce bench --json` records, with each figure beside its floor, for BENCHMARKS.md.

    python3 scripts/bench_summary.py out/paper_*.json > summary.md

One table per record: per method, ms/token and the speed-up over ar (measured side by side in that
record), the offloaded KV's floor per verification (bytes / pinned H2D peak) and the achieved H2D rate,
each stage's measured ms per forward beside its floor (weights + attended KV / device memory rate), the
prefill beside its FLOP floor, retrieval rebuild seconds, peak device memory (allocated, reserved, and
the memory plan's prediction), and, marked as such, the
projection at the record's assumed acceptance. Records from older commits (no stage times) print what
they have. Reads only what bench wrote: nothing here measures anything.
"""
from __future__ import annotations

import json
import os
import sys


def _f(x, fmt: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, fmt) + suffix


def _stages(run: dict) -> str:
    """'full 92.4/6.0; retrieval 8.1/4.6' (measured ms per forward / floor ms), node by node."""
    fl = run.get("floors") or {}
    steps, floors = fl.get("step_ms") or {}, fl.get("step_floor_ms") or {}
    return "; ".join(f"{name} {steps[name]:.2f}/{_f(floors.get(name), '.2f')}" for name in steps) or "-"


def cut_short(r: dict) -> str:
    """'CUT SHORT: 1 of 5 methods finished' for a record written before its bench ended ("complete": false,
    `tforce bench --record`); '' for a whole one (and for older records, which have no "complete")."""
    if r.get("complete") is not False:
        return ""
    return f"CUT SHORT: {len(r['runs'])} of {len(r.get('methods') or [])} methods finished"


def table(r: dict) -> str:
    cut = cut_short(r)
    head = (f"**{r['model']}** on {r['device']}, {r['prompt_tokens']} prompt + {r['gen_len']} tokens, {r['dtype']}, "
            f"temperature {r['temperature']}, --offload {r['offload']}"
            + (" — SYNTHETIC (random weights: acceptance meaningless)" if r["synthetic"] else "")
            + (f" — {cut}" if cut else "")
            + f"; ceilings: pinned H2D {_f(r.get('h2d_peak_gbps'), '.1f', ' GB/s')}, device memory "
              f"{_f(r.get('device_gbps'), '.0f', ' GB/s')}, matmul {_f(r.get('matmul_tflops'), '.0f', ' TFLOP/s')}")
    at = "" if r.get("project") is None else f" @{r['project']}"
    cols = ["method", "ms/token", "vs ar", "tokens/verif", "H2D GB/s", "floor ms/verif (H2D)",
            "ms/forward measured/floor", "prefill s (FLOP floor)", "rebuilds s (n)", "GPU GiB allocated/reserved/planned",
            f"projected ms/token{at}", f"projected vs ar{at}"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for run in r["runs"]:
        fl, p = run.get("floors") or {}, run.get("projection") or {}
        rebuilds = "-" if run.get("rebuilds") is None else f"{run['rebuild_s']:.2f} ({run['rebuilds']})"
        cells = [run["method"], _f(run["ms_per_token"], ".1f"), _f(run["speedup_vs_ar"], ".2f", "x"),
                 _f(run["tokens_per_verification"], ".2f"), _f(run["h2d_gbps"], ".1f"),
                 _f(run["floor_ms_per_verification"], ".1f"), _stages(run),
                 f"{run['prefill_s']:.2f} ({_f(fl.get('prefill_flop_floor_s'), '.2f')})", rebuilds,
                 "/".join(_f(run.get(k), ".1f") for k in ("gpu_mem_gib", "gpu_reserved_gib", "planned_peak_gib")),
                 _f(p.get("ms_per_token"), ".1f"),
                 _f(p.get("speedup_vs_ar"), ".2f", "x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out, bad = [], 0
    for path in paths:  # a record that cannot be tabulated is one line: the others' tables still come
        try:
            with open(path, encoding="utf-8") as fh:
                out.append(f"`{os.path.basename(path)}`\n\n" + table(json.load(fh)))
        except (OSError, ValueError) as e:
            out.append(f"{path}: not a bench record ({type(e).__name__}: {e})")
            bad += 1
        except (KeyError, TypeError) as e:  # e.g. a --batch record: no per-method figures
            out.append(f"{path}: not a record of single runs (no {e})")
            bad += 1
    print("\n\n".join(out))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
