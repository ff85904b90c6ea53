"""The bench's report as tables on a terminal: one row per method (and per peer), the projection's columns
where shown, split into as many tables as the width needs, and the notes on the peers under them.

Apart from bench/suite.py, which checks the options and runs the bench: this only formats a finished record
(the dict tforce/bench/suite.py returns), so it is read and tested without running anything."""
from __future__ import annotations

import os
import sys


def _fmt(x, fmt: str, suffix: str = "") -> str:
    """A figure as the tables show it: '-' where it is None (not applicable or not measured)."""
    return "-" if x is None else format(x, fmt) + suffix


def _rebuilds(run: dict) -> str:
    """Seconds in retrieval rebuilds during decoding and their count, e.g. '0.12 (3)'; '-' without any."""
    return "-" if run["rebuilds"] is None else f"{run['rebuild_s']:.2f} ({run['rebuilds']})"


# Column headers break where given, so that a column is as wide as its numbers, not its header.
COLUMNS = ("method", "ms/token", "speed-up\nvs ar", "accept\ndraft", "accept\nretrieval", "tokens/\nverif",
           "prefill\ns", "rebuild\ns (n)", "H2D GB/s\n(peak)", "floor ms\n/verif", "GPU\nGiB", "pinned\nGiB", "KV layers\nGPU/host")


def bench_rows(r: dict) -> list[list[str]]:
    from ..auto.calibration import entry_name  # auto's choice: "naive+lookup" where lookup took the draft's place

    peak = r["h2d_peak_gbps"]
    rows = []
    for run in r["runs"]:
        acc = run["acceptance"]
        h2d = "-" if run["h2d_gbps"] is None else f"{run['h2d_gbps']:.1f} ({_fmt(peak, '.1f')})"
        pl = run["placement"]
        label = run["method"] if not run.get("auto") else f"{run['method']}: {entry_name(run['auto'])}"
        rows.append([label, _fmt(run["ms_per_token"], ".1f"), _fmt(run["speedup_vs_ar"], ".2f", "x"),
                     _fmt(acc.get("draft"), ".1%"), _fmt(acc.get("retrieval"), ".1%"),
                     _fmt(run["tokens_per_verification"], ".2f"), _fmt(run["prefill_s"], ".2f"), _rebuilds(run), h2d,
                     _fmt(run["floor_ms_per_verification"], ".1f"), _fmt(run["gpu_mem_gib"], ".1f"),
                     _fmt(run["pinned_gib"], ".2f"), f"{pl['resident_layers']}/{pl['offloaded_layers']}"])
    if _projected(r):  # synthetic: measured acceptance means nothing there, the projection says what the times give
        for row, run in zip(rows, r["runs"]):
            p = run.get("projection") or {}
            row += [_fmt(p.get("ms_per_token"), ".1f"), _fmt(p.get("speedup_vs_ar"), ".2f", "x")]
    for peer in r.get("peers", []):
        ms = "not run" if peer["skipped"] else _fmt(peer["ms_per_token"], ".1f")
        cells = {0: f"{peer['method']} (peer)", 1: ms, 2: _fmt(peer["speedup_vs_ar"], ".2f", "x"),
                 5: _fmt(peer["tokens_per_verification"], ".2f"), 6: _fmt(peer["prefill_s"], ".2f"),
                 10: _fmt(peer["gpu_mem_gib"], ".1f")}
        rows.append([cells.get(i, "-") for i in range(len(_columns(r)))])
    return rows


def _projected(r: dict) -> bool:
    """Whether the table shows the projection: for synthetic runs, or when asked for at measured acceptance."""
    return r["synthetic"] or r.get("project") == "measured"


def _at(r: dict) -> str:
    return "measured acceptance" if r["project"] == "measured" else f"acceptance {r['project']:g} at every level"


def _columns(r: dict) -> tuple[str, ...]:
    """COLUMNS, and the projection's two where shown (see bench_rows)."""
    if not _projected(r):
        return COLUMNS
    at = "measured" if r["project"] == "measured" else f"{r['project']:g}"
    return COLUMNS + (f"projected\nms/token\n@{at}", f"projected\nspeed-up\n@{at}")


def floor_notes(r: dict) -> list[str]:
    """Lines under the table: per run, each level's ms per forward beside its floor (its weights and
    attended KV over the measured memory rate) and the overhead above it."""
    if not r.get("device_gbps"):
        return []
    lines = [f"per forward, ms: measured = floor (weights + attended KV bytes / {r['device_gbps']:.1f} GB/s "
             "measured) + overhead"]
    for run in r["runs"]:
        fl = run.get("floors") or {}
        if not fl.get("step_overhead_ms"):
            continue
        lines.append(f"  {run['method']}: " + _steps(fl))
    return lines if len(lines) > 1 else []


def _steps(fl: dict, rows: bool = False) -> str:
    """A run's floors (bench/run.py _floors) as "level measured = floor + overhead; ..."; rows: with the rows
    its forwards fed on average, in brackets (a batch's)."""
    return "; ".join(f"{name} {fl['step_ms'][name]:.2f} = {fl['step_floor_ms'][name]:.2f} + {over:.2f}"
                     + (f" [{fl['rows_per_forward'][name]:.1f}]" if rows else "")
                     for name, over in fl["step_overhead_ms"].items())


def peer_notes(r: dict) -> list[str]:
    """Lines under the table: what the peers are, and per peer its tokens against ar's or why it did not run."""
    peers = r.get("peers", [])
    if not peers:
        return []
    hf = [p for p in peers if p["method"] != "llama.cpp"]
    lines = [f"peers: {hf[0]['peer']} generate on the same weights and token ids ({hf[0]['attention']} "
             f"attention, EOS ignored); ms/token from its first new token to its last"] if hf else ["peers:"]
    for p in peers:
        if p["method"] == "llama.cpp" and not p["skipped"]:
            lines.append(f"  llama.cpp: {p['peer']}, llama-bench on the same GGUF ({p['weights']} weights, "
                         f"as in the file), {p['threads']} threads, decode after a cache of the prompt's length "
                         f"filled with its own tokens (not compared)")
        if p["skipped"]:
            lines.append(f"  {p['method']}: not run: {p['skipped']}")
        elif p["vs_ar"] is not None:
            lines.append(f"  {p['method']}: tokens vs ar: {p['vs_ar']}")
    if r["temperature"] != 0:
        lines.append("  sampled (temperature > 0): tokens are not compared with ar's")
    elif not any(run["method"] == "ar" for run in r["runs"]):
        lines.append("  no ar in --methods: tokens are not compared")
    elif r["dtype"] != "float32" and any(p["vs_ar"] not in (None, "match") for p in peers):
        lines.append(f"  {r['dtype']}: rounding differs between implementations, so greedy tokens may part "
                     f"after a near tie (README: Exactness)")
    return lines


def _column_groups(widths: list[int], width: int) -> list[list[int]]:
    """Column indices per table: every table repeats column 0 (the method) and fits `width` terminal
    columns (a bordered cell takes its text + 3), so that no number is ever cut."""
    groups, used = [[0]], 4 + widths[0]
    for i, w in enumerate(widths[1:], start=1):
        if used + w + 3 > width and len(groups[-1]) > 1:
            groups.append([0])
            used = 4 + widths[0]
        groups[-1].append(i)
        used += w + 3
    return groups


def print_bench(r: dict, console=None) -> None:
    """The bench table, split into as many tables (each led by the method) as the terminal's width needs."""
    from rich.console import Console
    from rich.table import Table

    if console is None:  # a file or pipe gets one wide table unless COLUMNS says otherwise
        wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        console = Console(width=200 if wide else None)
    rows, columns = bench_rows(r), _columns(r)
    widths = [max(len(line) for cell in [c] + [row[i] for row in rows] for line in cell.split("\n"))
              for i, c in enumerate(columns)]
    groups = _column_groups(widths, console.width)
    title = (f"tforce bench: {r['model']} on {r['device']}, {r['prompt_tokens']} prompt + {r['gen_len']} tokens, "
             f"{r['dtype']}" + (f", {r['weights']} projections" if r.get("weights", "auto") != "auto" else "") +
             f", temperature {r['temperature']}" + ("  SYNTHETIC (random weights)" if r["synthetic"]
                                                                else ""))
    caption = (f"pinned H2D peak: {_fmt(r['h2d_peak_gbps'], '.1f', ' GB/s')}; floor = offloaded KV bytes per "
               f"verification / peak; warm-up {_fmt(r['warmup_s'], '.1f', ' s')} (not in the runs); "
               f"'-' = not applicable or not measured"
               + (f"; projected = NOT measured: this run's stage times at {_at(r)} (tforce/auto/projection.py)"
                  if _projected(r) else ""))
    for n, group in enumerate(groups):
        t = Table(title=title if n == 0 else None, caption=caption if n == len(groups) - 1 else None)
        for i in group:
            t.add_column(columns[i], justify="left" if i == 0 else "right", min_width=widths[i])
        for row in rows:
            t.add_row(*(row[i] for i in group))
        console.print(t)
    for line in floor_notes(r) + peer_notes(r):
        console.print(line, highlight=False, markup=False)


def print_batch(r: dict) -> None:
    """`tforce bench --batch`'s table, then each level's forwards beside their floors and the projection."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"tforce bench --batch {r['batch']}: {r['model']} on {r['device']}, {r['batch']} x "
                    f"{r['prompt_tokens']} prompt + {r['gen_len']} tokens, {r['dtype']}, temperature "
                    f"{r['temperature']}" + ("  SYNTHETIC (random weights)" if r["synthetic"] else ""),
              caption=f"decode tokens/s of all rows; warm-up {r['warmup_s']:.1f} s (not in the runs)")
    for c in ("method", "batch\ntokens/s", "one at a time\ntokens/s", "speed-up", "rows equal\nalone"):
        t.add_column(c, justify="left" if c == "method" else "right")
    for run in r["runs"]:
        eq = "-" if run["rows_equal_alone"] is None else ("yes" if run["rows_equal_alone"] else "NO")
        t.add_row(run["method"], _fmt(run["batch_tokens_per_s"], ".1f"), _fmt(run["one_at_a_time_tokens_per_s"], ".1f"),
                  _fmt(run["speedup_vs_one_at_a_time"], ".2f", "x"), eq)
    console = Console()
    console.print(t)
    for line in _batch_floor_notes(r) + _projection_notes(r):
        console.print(line, highlight=False, markup=False)


def _projection_notes(r: dict) -> list[str]:
    """Lines under the table: per run, the batch and one at a time projected at the assumed acceptance."""
    lines = []
    for run in r["runs"]:
        p = run.get("projection") or {}
        if p.get("speedup_vs_one_at_a_time") is None:
            continue
        at = p["acceptance"] if not isinstance(p["acceptance"], dict) else \
            ", ".join(f"{k} {v:.2f}" for k, v in p["acceptance"].items() if v is not None) or "-"
        lines.append(f"  {run['method']} at acceptance {at}: batch {1000 / p['batch']['ms_per_token']:.1f} tokens/s, "
                     f"one at a time {1000 / p['one_at_a_time']['ms_per_token']:.1f}, "
                     f"{p['speedup_vs_one_at_a_time']:.2f}x")
    head = "projected from these stage times (NOT measured; a batch waits for its slowest row's drafts):"
    return [head] + lines if lines else []


def _batch_floor_notes(r: dict) -> list[str]:
    """Lines under the batch table: per run, each level's ms per forward in the batch and one at a time, each
    as measured = floor + overhead, with the rows its forwards fed on average."""
    if not r.get("device_gbps"):
        return []
    lines = [f"per forward, ms: measured = floor (weights once + each fed row's attended KV, over "
             f"{r['device_gbps']:.1f} GB/s measured) + overhead [rows fed per forward]"]
    for run in r["runs"]:
        for label, fl in (("batch", run.get("floors")), ("one at a time", run.get("one_at_a_time_floors"))):
            if fl and fl.get("step_overhead_ms"):
                lines.append(f"  {run['method']}, {label}: " + _steps(fl, rows=True))
    return lines if len(lines) > 1 else []
