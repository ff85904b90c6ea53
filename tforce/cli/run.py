"""`tforce run`: a prompt in, the target's exact continuation streamed out."""
from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from typing import Optional

import typer

from .. import threads
from ..text.demo import demo_prompt
from ..config import AUTO, METHODS, Speculation
from ..errors import DoesNotFit, UsageError
from ..engine.events import Events
from ..engine.stops import StopStrings
from .app import app
from . import options as o
from .batch_run import check_options, read_batch, run_batch
from .common import check_memory, guarded, say, flag
from .setup import Setup, configure, read_draft_config, dtype_bytes, read_prompt, check_fits, notices
from ..text.stream import TextStream
from .live import shared_with_stderr, summary_line, text_progress


@app.command()
@o.shared()
def run(
    prompt_file_arg: Optional[str] = typer.Argument(None, metavar="[PROMPT_FILE]",
                                                    help="Document to read ('-' = stdin)."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f", help="Document to read ('-' = stdin)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Text placed after the document."),
    as_json: bool = flag("--json", "Print one JSON object instead of streaming text."),
    batch: Optional[str] = typer.Option(None, "--batch", help="JSON-lines file of prompts ('-' = stdin), one "
                                        "{\"prompt\" and/or \"file\", \"id\", \"max_new_tokens\"} a line, run as "
                                        "one batch (as several in turn when it does not fit); one JSON line out "
                                        "per prompt (--json: one object holding them; every --method; --tp; "
                                        "--load-kv, not --save-kv)."),
    opts: Optional[dict] = None,
) -> None:
    """Generate text after a (long) prompt, streaming it to stdout."""
    params = {**opts, **{k: v for k, v in locals().items() if k != "opts"}}

    def body():
        if prompt_file_arg is not None and prompt_file is not None and prompt_file_arg != prompt_file:
            raise UsageError("give the prompt file once: as an argument or with --prompt-file")
        if batch is not None:
            given = (prompt_file_arg, prompt_file, prompt)
            check_options(opts["method"], given != (None,) * 3, opts["save_kv"] is not None)
        setup = configure(params, calibrate=batch is None)
        # the prompts before any notice (notices), so that a bad prompt is the only line
        if batch is not None:
            items = read_batch(batch)
        else:
            text = read_prompt(prompt_file if prompt_file is not None else prompt_file_arg, prompt,
                                demo_prompt() if opts["model"] is None else None)
        if batch is not None:
            return run_batch(items, setup, as_json)
        _run(text, setup, as_json)

    guarded(body)


def _run(text: str, setup: Setup, as_json: bool) -> None:
    with contextlib.ExitStack() as stack:  # what --method auto's calibration keeps for the run (a KV snapshot)
        _run_in(stack, text, setup, as_json)


def _run_in(stack: contextlib.ExitStack, text: str, setup: Setup, as_json: bool) -> None:
    from ..engine.generate import generate
    from ..snapshot.format import read_manifest
    from ..model.registry import resolve

    draft, device, dtype, world = setup.draft, setup.device, setup.dtype, setup.world
    config = setup.config
    path, model_config, tok = setup.target_files()  # no weights yet: the prompt and memory are checked first
    load_kv = config.load_kv
    fmt = setup.prompt_format(tok, path, None if load_kv is None else read_manifest(load_kv)["tokens"])
    ids = fmt.prompt_ids(text)
    context = model_config.max_position_embeddings
    check_fits(len(ids), context)
    notices(setup, fmt)
    max_new = min(config.max_new_tokens, context - len(ids))
    if max_new < config.max_new_tokens:
        say(f"tforce: note: the model's context ({context} tokens) leaves room for {max_new} new tokens after "
             f"the {len(ids)}-token prompt, not the {config.max_new_tokens} asked for")
    draft_config = read_draft_config(draft, model_config, tok) if draft else None
    auto = config.method == AUTO  # planned here, once the models are loaded (one process: world == 1)
    if auto and max_new == 0:  # nothing to generate: nothing to plan (or calibrate) for
        auto, config = False, config.with_options(method="ar")
    target = small = None  # split runs: the workers load the weights
    if world == 1:
        def check(method: str) -> None:
            check_memory(model_config, draft_config, len(ids) + max_new, dtype_bytes(dtype, device), device,
                          config, method)

        unfit = unfit_methods(check, draft_config is not None or config.speculation.proposer == "lookup") if auto \
            else check(config.method)
        target, small = setup.load()
    choice = None
    if auto:
        from ..auto.chooser import choose

        kv_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="tforce-auto-"))
        choice = choose(target, small, ids, config, fixed=setup.gammas_given, exclude=unfit, kv_dir=kv_dir,
                        events=Events(on_step=threads.tick))
        say(choice.line())
        config = choice.applied(config)  # the calibration's prefill of the prompt loaded, where it kept one
        small = small if config.speculation.uses_draft else None
    stops = StopStrings(tok, setup.stops)
    stream = TextStream(tok, sys.stdout, enabled=not as_json, stops=stops or None)
    shown = config.method + (" with lookup" if config.speculation.looks_up else "")  # the panel's and summary's
    progress = text_progress(stream, len(ids), max_new, shown, as_json)
    events = Events(on_tokens=lambda r, tokens, acceptance: stream.add(tokens),
                    on_round=progress.on_round if progress else None,
                    on_prefill=progress.on_prefill if progress else None,
                    on_plan=progress.on_plan if progress else None, until=stops.cut if stops else None,
                    on_step=threads.tick)
    try:
        if world > 1:
            from ..parallel.tp import generate_tp

            result = generate_tp(str(path), str(resolve(draft)) if draft else None, ids, world, device, dtype,
                                 config, events)
        else:
            result = generate(target, ids, config, small, events)
        out = stream.finish()
    except BaseException:  # end the live view and keep the text written so far (Ctrl-C, errors)
        if progress:
            progress.close()
        end_line(stream.printed)
        raise
    if not as_json:
        end_line(out)
    _kv_notes(setup.config, result.stats, len(ids))  # the user's snapshots, not auto's own
    if choice is not None:
        choice.remember(result.stats, len(result.tokens))
    if as_json:
        record = {"text": out, "tokens": result.tokens, "prompt_tokens": len(ids), "method": config.method,
                  "auto": None if choice is None else choice.record(),
                  "chat_template": fmt.templated, "stopped_by": stops.matched(result.tokens),
                  "device": device, "stats": result.stats, "cpu_threads": threads.choice()}
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
        return
    if progress:
        progress.finish(result.stats)
    else:
        say(summary_line(len(result.tokens), len(ids), shown, result.stats))


def unfit_methods(check, has_draft: bool) -> set[str]:
    """--method auto: the methods whose caches do not fit in memory (check(method) raises DoesNotFit), left
    out of the plan; ar's refusal is the run's (every other method needs more)."""
    check("ar")
    unfit = set()
    for method in METHODS:
        if method != "ar" and (has_draft or not Speculation(method=method).uses_draft):
            try:
                check(method)
            except DoesNotFit:
                unfit.add(method)
    return unfit


def _kv_notes(config, stats: dict, cached: int) -> None:
    """What a snapshot saved or reused, on stderr (`cached`: the tokens the caches hold after prefill, the
    whole prompt; of a prompt the snapshot holds whole, its last token is fed again for the first token)."""
    if config.load_kv is not None:
        reused, held = stats["kv_reused"], stats["kv_snapshot_tokens"]
        say(f"tforce: KV snapshot {config.load_kv}: reused {reused} of {cached} prompt tokens "
             f"(loaded in {stats['load_kv_s']:.2f} s, then prefilled {cached - reused})"
             + ("" if reused >= min(cached - 1, held)
               else f"; the prompt leaves the snapshot's {held}-token prefix at token {reused}"))
    if config.save_kv is not None:
        say(f"tforce: KV snapshot of {cached} prompt tokens written to {config.save_kv} "
             f"in {stats['save_kv_s']:.2f} s")


def end_line(text: str) -> None:
    """On a terminal, or a file or pipe shared with stderr, end the text's line so that what stderr writes
    next (the summary, an interruption notice) starts a line of its own."""
    if (sys.stdout.isatty() or shared_with_stderr()) and text and not text.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------------------------- info
