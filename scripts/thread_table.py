"""Tabulate scripts/thread_bench.sh's reports: median ms/token of tforce's methods and transformers' peers
for each model, load and threading setting, with the threads and wait policy the run actually used.

    python scripts/thread_table.py thread-out            # a Markdown table on stdout
    python scripts/thread_table.py method-out auto,ar,naive,retrieval,streaming,triforce,hf,hf-assisted
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from tforce.auto.calibration import entry_name

NAME = re.compile(r"(?P<model>.+)-load(?P<load>\d+|T)-(?P<setting>[A-Za-z0-9-]+?)-r\d+\.json$")
COLUMNS = ("ar", "triforce", "hf", "hf-assisted")


def rows(folder: Path) -> dict:
    """(model, load, setting) -> {"used": {...}, "n": repeats, column: [ms/token of each repeat]}"""
    table: dict = {}
    for path in sorted(folder.glob("*.json")):
        m = NAME.match(path.name)
        if m is None:
            continue
        try:
            report = json.loads(path.read_text())
        except ValueError:
            continue
        cells = table.setdefault((m["model"], m["load"], m["setting"]), {"used": set(), "n": 0})
        t = report.get("cpu_threads") or {}
        policy = t.get("omp_wait_policy", report.get("omp_wait_policy")) or "default"
        changes = f" ({t['changes']} changes)" if t.get("changes") else ""
        cells["used"].add(f"{policy}/{t.get('threads')}{changes}")
        cells["n"] += 1
        for run in report.get("runs", []) + report.get("peers", []):
            if run.get("ms_per_token") is not None:
                cells.setdefault(run["method"], []).append(run["ms_per_token"])
            if run.get("auto"):  # what auto chose, shown beside its time
                cells.setdefault("chose", set()).add(entry_name(run["auto"]))  # "naive+lookup": lookup for the draft
    return table


def main(folder: str, columns=COLUMNS) -> None:
    table = rows(Path(folder))
    print("| model | busy processes | setting | wait/threads used | runs | " + " | ".join(columns) + " | ar / hf |")
    print("|---|---|---|---|---|" + "---|" * (len(columns) + 1))
    for (model, load, setting), cells in sorted(table.items()):
        values = {c: statistics.median(cells[c]) for c in columns if c in cells}
        ratio = f"{values['ar'] / values['hf']:.2f}" if "ar" in values and "hf" in values else ""
        chose = "/".join(sorted(cells.get("chose", ())))
        shown = " | ".join((f"{values[c]:.2f}" + (f" ({chose})" if c == "auto" and chose else ""))
                           if c in values else "" for c in columns)
        used = ", ".join(sorted(cells["used"]))
        print(f"| {model} | {load} | {setting} | {used} | {cells['n']} | {shown} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "thread-out",
         tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else COLUMNS)
