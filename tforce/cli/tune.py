"""`tforce tune`: what `--method auto` chooses for a prompt on this machine, and each method's predicted
ms/token beside a run that measures it (docs/auto.md)."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ..errors import UsageError
from .app import app
from . import options as o
from .common import check_memory, guarded, say, flag
from .setup import configure, read_draft_config, dtype_bytes, read_prompt, notices

# run's options that tune does not take: their defaults (options.py)
FIXED = ("method", "gamma1", "gamma2", "top_k", "seed", "ignore_eos", "chunk_size", "draft_budget", "sinks",
         "prefill_chunk", "rebuild_every", "rebuild_below", "policy", "deterministic", "offload", "gpu_memory",
         "save_kv", "load_kv", "system", "stop", "tp", "gpus")


@app.command()
def tune(
    prompt_file: str = typer.Argument(..., metavar="PROMPT_FILE", help="Document to plan for ('-' = stdin)."),
    model: Optional[str] = o.MODEL,
    draft: Optional[str] = o.DRAFT,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Tokens of each measured run."),
    temperature: float = o.TEMPERATURE,
    top_p: float = o.TOP_P,
    budget: int = o.BUDGET,
    device: str = o.DEVICE,
    threads: int = o.THREADS,
    dtype: str = o.DTYPE,
    template: str = o.TEMPLATE,
    as_json: bool = flag("--json", "Print one JSON object."),
) -> None:
    """Measure stage costs again, then run every method auto may choose: predicted vs measured ms/token."""
    params = {name: getattr(o, name.upper()).default for name in FIXED}
    params.update(model=model, draft=draft, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                  budget=budget, device=device, threads=threads, dtype=dtype, template=template)

    def body():
        if max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        setup = configure(params)
        text = read_prompt(prompt_file, None)
        report = _tune(text, setup)
        if as_json:
            sys.stdout.write(json.dumps(report) + "\n")
        else:
            sys.stdout.write(_table(report))
        sys.stdout.flush()

    guarded(body)


def _tune(text: str, setup) -> dict:
    from ..auto.calibration import entry_name, remember
    from .. import threads
    from ..auto.chooser import choose, options_of
    from ..engine.events import Events
    from ..engine.generate import generate
    from .run import unfit_methods

    path, model_config, tok = setup.target_files()
    fmt = setup.prompt_format(tok, path)
    ids = fmt.prompt_ids(text)
    config = setup.config
    new = config.max_new_tokens
    if len(ids) + new > model_config.max_position_embeddings:
        raise UsageError(f"the prompt is {len(ids)} tokens: with {new} new ones it exceeds "
                         f"the model's context ({model_config.max_position_embeddings})")
    notices(setup, fmt)
    draft_config = read_draft_config(setup.draft, model_config, tok) if setup.draft else None

    def check(method: str) -> None:
        check_memory(model_config, draft_config, len(ids) + new, dtype_bytes(setup.dtype, setup.device),
                      setup.device, config, method)

    unfit = unfit_methods(check, draft_config is not None or config.speculation.proposer == "lookup")
    target, small = setup.load()
    say(f"tforce: tune: measuring the stage costs of every method on {len(ids)} prompt tokens")
    step = Events(on_step=threads.tick)
    choice = choose(target, small, ids, config, exclude=unfit, refresh=True, events=step)
    say(choice.line())
    rows = []
    for c in choice.candidates:
        say(f"tforce: tune: {entry_name(c)}: {new} tokens")
        gammas = {k: c[k] for k in ("gamma1", "gamma2") if k in c}
        timed = config.with_options(**options_of(c), ignore_eos=True, seed=0)
        r = generate(target, ids, timed, small if timed.speculation.uses_draft else None, step)
        if choice.cache is not None and gammas:
            remember(choice.entry, entry_name(c), r.stats["acceptance"], len(r.tokens), gammas, choice.folder)
        rows.append({**c, "measured_ms_per_token": r.stats["ms_per_token"],
                     "measured_acceptance": r.stats["acceptance"]})
    return {"model": setup.target, "draft": setup.draft, "device": setup.device, "prompt_tokens": len(ids),
            "new_tokens": new, "auto": choice.record(), "candidates": rows}


def _table(report: dict) -> str:
    """One line per method (naive+lookup: naive with lookup in the draft's place): its best gammas, predicted
    and measured ms/token; auto's choice marked."""
    from ..auto.calibration import entry_name

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    chosen = entry_name(report["auto"])
    lines = [f"{'method':<16}{'gamma1':>7}{'gamma2':>7}{'predicted':>11}{'measured':>10}{'ratio':>7}  ms/token"]
    for c in report["candidates"]:
        ratio = c["measured_ms_per_token"] / c["ms_per_token"] if c["measured_ms_per_token"] else None
        mark = " (auto)" if entry_name(c) == chosen else ""
        lines.append(f"{entry_name(c):<16}{f(c.get('gamma1'), 'd'):>7}{f(c.get('gamma2'), 'd'):>7}"
                     f"{c['ms_per_token']:>11.2f}{f(c['measured_ms_per_token'], '.2f'):>10}{f(ratio, '.2f'):>7}{mark}")
    return "\n".join(lines) + "\n"
