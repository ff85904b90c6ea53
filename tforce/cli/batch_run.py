"""`tforce run --batch FILE.jsonl`: several prompts through one decode loop, one JSON line out per prompt.

Each non-blank line of FILE ('-' = stdin) is one JSON object: {"prompt": TEXT} or {"file": PATH} (a
document, read as `tforce run PATH` reads it) or both (the document, then the prompt, joined by a blank
line, as `tforce run PATH --prompt TEXT`), with an optional "id" (default: the line number) and
"max_new_tokens" (default: --max-new-tokens). The whole file is checked before any model is loaded; a bad
line is one error naming its line. A file whose plan does not fit in memory runs as consecutive batches of
the most rows that fit, each planned for its own rows, one after another (batch_groups.py). With --stop,
each row ends at its first stop string, where `tforce run --stop` ends that prompt. Results go to stdout
in the file's order, one JSON object a line (--json: one object, {"results": [those objects], "stats": the
batch's figures, ...}); nothing is written anywhere else. If the batch is interrupted or fails half way,
the rows finished so far (of every batch run) are still written (in the file's order, with "stats": null;
--json: in one object with "complete": false), then the error.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from .. import threads
from ..errors import UsageError
from ..engine.events import Events
from ..engine.stops import StopStrings
from .batch_groups import plan_groups, run_groups
from .live import Progress, Status
from .common import check_memory, decode_text, say

KEYS = {"prompt", "file", "id", "max_new_tokens"}


def read_batch(source: str) -> list[tuple[object, str, Optional[int]]]:
    """(id, text, max_new_tokens or None) per prompt of a JSON-lines file, every line checked."""
    try:
        data = sys.stdin.buffer.read() if source == "-" else Path(source).expanduser().read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read batch file {source}: {e.strerror or e}") from e
    items, ids = [], {}  # id -> its line
    # JSON Lines ends lines at \n only: a JSON string may hold U+2028 or U+0085 unescaped (splitlines splits there)
    content = decode_text(data, f"batch file {source}").removeprefix("\ufeff")  # a BOM: RFC 8259 lets us ignore it
    for n, line in enumerate(content.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"batch file {source}, line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise UsageError(f'{where}: expected an object like {{"prompt": "...", "id": "..."}}')
        if set(obj) - KEYS:
            raise UsageError(f"{where}: unknown key(s) {', '.join(sorted(set(obj) - KEYS))}; "
                             f"a line takes prompt, file, id and max_new_tokens")
        if "prompt" not in obj and "file" not in obj:
            raise UsageError(f'{where}: give "prompt" (text) or "file" (a document path)')
        for key in ("prompt", "file"):
            if key in obj and not isinstance(obj[key], str):
                raise UsageError(f'{where}: "{key}" must be a string')
        text = "\n\n".join(p for p in (_document(obj.get("file"), where), obj.get("prompt", "")) if p.strip())
        if not text:
            raise UsageError(f"{where}: the prompt is empty")
        key = obj.get("id", n)
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise UsageError(f'{where}: "id" must be a string or an integer')
        if key in ids:
            implicit = "" if "id" in obj else ' (its line number, as it gives no "id")'
            raise UsageError(f"{where}: id {key!r}{implicit} is line {ids[key]}'s id; give each line its own")
        budget = obj.get("max_new_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise UsageError(f'{where}: "max_new_tokens" must be an integer >= 0')
        ids[key] = n
        items.append((key, text, budget))
    if not items:
        raise UsageError(f"batch file {source} holds no prompts")
    return items


def _document(path: Optional[str], where: str) -> str:
    if path is None:
        return ""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise UsageError(f"{where}: cannot read {path}: {e.strerror or e}") from e
    return decode_text(data, f"{path} ({where})")


def check_options(method: str, prompt_given: bool, save_kv: bool) -> None:
    """What --batch cannot be combined with, refused before anything is read."""
    from ..engine.batch import check_batchable

    if method != "auto":  # auto becomes one of the batch's methods (setup.configure)
        check_batchable(method)
    if save_kv:  # one snapshot per file of prompts would be whose?
        raise UsageError("--batch saves no KV snapshot: save the document's with `tforce run --save-kv` (or chat), "
                         "then give the batch --load-kv")
    if prompt_given:
        raise UsageError("--batch takes its prompts from the batch file: no PROMPT_FILE or --prompt")


def run_batch(items: list[tuple[object, str, Optional[int]]], setup, as_json: bool) -> None:
    """setup: run.Setup (the models, device, dtype, prompt format and the run's configuration)."""
    from ..engine.batch import generate_batch
    from ..engine.rates import decoded
    from ..model.registry import resolve
    from ..snapshot.format import read_manifest
    from .setup import read_draft_config, dtype_bytes, check_fits, notices

    draft, device, dtype, world = setup.draft, setup.device, setup.dtype, setup.world
    config = setup.config
    path, model_config, tok = setup.target_files()
    load_kv = config.load_kv
    fmt = setup.prompt_format(tok, path, None if load_kv is None else read_manifest(load_kv)["tokens"])
    prompts = [fmt.prompt_ids(text) for _, text, _ in items]
    budgets = [config.max_new_tokens if n is None else n for _, _, n in items]
    context = model_config.max_position_embeddings
    for (key, _, _), ids in zip(items, prompts):
        check_fits(len(ids), context, f"prompt {key!r}")
    notices(setup, fmt)
    short = [f"{key!r} gets {context - len(ids)}" for (key, _, _), ids, n in zip(items, prompts, budgets)
             if n > context - len(ids)]
    if short:  # as `tforce run` notes it for one prompt
        say(f"tforce: note: the model's context ({context} tokens) leaves room for fewer new tokens than asked: "
             + ", ".join(short))
    lengths = [len(ids) + min(n, context - len(ids)) for ids, n in zip(prompts, budgets)]  # prompt + new tokens
    draft_config = read_draft_config(draft, model_config, tok) if draft else None

    def check(rows: range) -> None:  # as the engine plans a batch: its rows, each of its longest row's capacity
        check_memory(model_config, draft_config, max(lengths[r] for r in rows), dtype_bytes(dtype, device), device,
                      config, rows=len(rows))

    # in one process the file is split into the batches that fit; split over ranks (--tp), the check above
    # plans one process, not a rank's shard, so the ranks plan the file as one batch and run_groups halves
    # it each time they refuse it (their DoesNotFit arrives as such: parallel/rank_worker.py)
    groups = plan_groups(check, len(prompts)) if world == 1 else [range(len(prompts))]
    if len(groups) > 1:
        say(f"tforce: the batch of {len(prompts)} does not fit: running it as {len(groups)} batches of at most "
             f"{max(map(len, groups))}")
    if world == 1:
        target, small = setup.load()
    stops = StopStrings(tok, setup.stops)
    finished: dict[int, list[int]] = {}  # prompt index in the file -> its tokens, as each row finishes

    def record(r: int, tokens: list[int], stats) -> dict:  # as `tforce run --json` writes one, with the id
        return {"id": items[r][0], "text": stops.shown(tok.decode(tokens, skip_special_tokens=True), final=True),
                "tokens": tokens, "prompt_tokens": len(prompts[r]), "method": config.method,
                "stopped_by": stops.matched(tokens), "device": device, "stats": stats}

    # the live view: on a terminal, as a single run's (live.py), and not with --json
    progress = Progress(Status([len(p) for p in prompts], budgets, config.method), f"tforce {config.method} --batch") \
        if sys.stderr.isatty() and not as_json else None
    status = progress.status if progress else None

    def done(r: int, out: list[int]) -> None:
        finished[r] = out
        if status:
            status.on_row()

    def run(rows: range, g: int) -> list:
        # batch g is seeded seed + g: the same seed for every batch would draw the same random numbers
        # for the rows of each, so that equal prompts in two batches got equal samples; from 2**64 on (past
        # what torch takes) it wraps around, modulo 2**64 as torch reads seeds
        seed = config.sampling.seed
        seed = None if seed is None else seed + g - (2**64 if seed + g >= 2**64 else 0)
        if status:
            status.start(rows)
        group = config.with_options(max_new_tokens=[budgets[r] for r in rows], seed=seed)
        events = Events(on_row=lambda i, tokens: done(rows[i], tokens), until=stops.cut if stops else None,
                        on_prefill=status.on_prefill if status else None,
                        on_round=status.on_round if status else None, on_step=threads.tick)
        if world > 1:
            from ..parallel.tp import generate_batch_tp

            out = generate_batch_tp(str(path), str(resolve(draft)) if draft else None, [prompts[r] for r in rows],
                                    world, device, dtype, group, events)
        else:
            out = generate_batch(target.model, [prompts[r] for r in rows], group,
                                 draft=small.model if small else None, events=events)
        if status:
            status.end()
        return out

    results, parts = [], []  # parts: each batch's figures
    try:
        for group in run_groups(groups, run):  # in the file's order
            results += group
            parts.append({"new_tokens": sum(len(r.tokens) for r in group),
                          "decoded": sum(decoded(len(r.tokens)) for r in group), **group[0].stats})
    except BaseException:
        # interrupted or failed half way: the rows finished so far (the earlier batches' and the current
        # one's), in the file's order, without the batch's statistics (not measured to its end); the error
        # follows on stderr, after the live view has ended
        if progress:
            progress.close()
        _write([record(r, finished[r], None) for r in sorted(finished)], None, config.method, device, as_json)
        raise
    stats = _combined(parts)
    if progress:  # its last state stays on screen, above the lines when stdout is the terminal too
        progress.finish(stats)
    _write([record(r, result.tokens, result.stats) for r, result in enumerate(results)], stats, config.method,
           device, as_json)
    if load_kv is not None:
        _snapshot_note(load_kv, results, prompts, sum(p["load_kv_s"] for p in parts))
    if as_json:  # the figures are in the object, as `tforce run --json` prints no summary
        return
    n, rate, ms = stats["new_tokens"], stats["batch_tokens_per_s"], stats["ms_per_token"]
    rebuild = "" if stats["rebuild_s"] is None else \
        f"; retrieval rebuilds {stats['prefill_rebuild_s']:.2f} s at prefill, {stats['rebuild_s']:.2f} s decoding"
    split = "" if len(parts) == 1 else f" in {len(parts)} batches of at most {stats['batch_size']} (times summed)"
    say(f"tforce: {config.method}: batch of {len(results)} prompts{split}: {n} tokens; prefill "
         f"{stats['prefill_s']:.2f} s; decode {stats['decode_s']:.2f} s "
         f"({'n/a' if rate is None else format(rate, '.1f')} tokens/s, "
         f"{'n/a' if ms is None else format(ms, '.1f')} ms/token for the batch){rebuild}")


def _snapshot_note(load_kv: str, results: list, prompts: list[list[int]], seconds: float) -> None:
    """What the rows took from the snapshot (read once per batch: `seconds` in all), on stderr."""
    reused = [r.stats["kv_reused"] for r in results]
    held = results[0].stats["kv_snapshot_tokens"]
    using = sum(1 for c in reused if c)
    say(f"tforce: KV snapshot {load_kv} ({held} tokens): reused by {using} of {len(results)} prompts, "
         f"{sum(reused)} tokens in all (loaded in {seconds:.2f} s), then prefilled "
         f"{sum(map(len, prompts)) - sum(reused)}")


def _combined(parts: list[dict]) -> dict:
    """The whole file's figures from each batch's: times and tokens summed, tokens/s and ms/token over all
    batches' decode time and the tokens it made (prefills and the first token of each row, which the prefill
    gives, excluded, as in one batch's), batch_size the largest batch's rows."""
    from ..engine.rates import ms_per_token, rate

    n, decode = sum(p["new_tokens"] for p in parts), sum(p["decode_s"] for p in parts)
    decoded = sum(p["decoded"] for p in parts)
    rebuilds = {k: None if parts[0][k] is None else sum(p[k] for p in parts) for k in ("prefill_rebuild_s",
                                                                                      "rebuild_s")}
    return {"batch_size": max(p["batch_size"] for p in parts), "batches": len(parts),
            "prefill_s": sum(p["prefill_s"] for p in parts), "decode_s": decode,
            "batch_tokens_per_s": rate(decoded, decode),
            "ms_per_token": ms_per_token(decoded, decode), **rebuilds, "new_tokens": n}


def _write(records: list[dict], stats: Optional[dict], method: str, device: str, as_json: bool) -> None:
    """The rows' records as JSON lines, or (as_json) one object holding them and the batch's `stats` (None
    and "complete": false when the batch stopped half way)."""
    if as_json:
        whole = {"method": method, "device": device, "complete": stats is not None, "stats": stats,
                 "results": records}
        sys.stdout.write(json.dumps(whole) + "\n")
    else:
        sys.stdout.writelines(json.dumps(record) + "\n" for record in records)
    sys.stdout.flush()
