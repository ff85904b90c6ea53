"""`tforce eval`: acceptance of the middle-level policies on book and passkey prompts (logic in
tforce/eval/run.py); writes results.json, results.md and PNG plots to --out."""
from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ..config import POLICIES, Sampling, Speculation
from ..errors import UsageError
from ..model.registry import LOOKUP
from . import options as o
from .app import app
from .common import DTYPES, THREADS_HELP, pick_device, guarded, say, set_threads, flag
from .setup import default_draft



def _list(text: str, kind, name: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{name} must be a comma-separated list of numbers, got {text!r}") from None
    if not values:
        raise UsageError(f"--{name} is empty")
    return values


@app.command("eval")
def eval_(
    model: str = typer.Option(..., "--model", "-m", help="Target: a folder, hub id or short name."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Small draft (for the gamma1 sweep and triforce "
                                                               "speed; default: the registry's or X-draft), or "
                                                               "lookup (n-gram lookup, no model)."),
    task: str = typer.Option("both", "--task", help="pg19 | needle | both"),
    books: Optional[str] = typer.Option(None, "--books", help="Glob of plain-text books, e.g. 'books/*.txt' "
                                        "(held out of the models' training); default: $TFORCE_BOOKS."),
    context: str = typer.Option("256,512,1000", "--context", help="Prompt lengths in tokens (comma-separated)."),
    budgets: str = typer.Option("32,64,128,256,512", "--budgets", help="Budget sweep (Fig. 6a)."),
    chunk_sizes: str = typer.Option("4,8,16,32", "--chunk-sizes", help="Chunk-size sweep (Fig. 6b)."),
    gamma1s: str = typer.Option("1,2,3,4", "--gamma1s", help="gamma1 sweep (triforce)."),
    gamma2s: str = typer.Option("2,4,6,8,12", "--gamma2s", help="gamma2 sweep (retrieval drafting)."),
    temperatures: str = typer.Option("0,0.6,1.0", "--temperatures", help="Temperature sweep (Table 2)."),
    policies: str = typer.Option(",".join(("topk", "streaming", "h2o", "retrieval", "shared")), "--policies",
                                 help="Middle-cache policies: topk, streaming, h2o, retrieval, shared."),
    budget: int = typer.Option(128, "--budget", help="Budget of Table 1 and the other sweeps."),
    chunk_size: int = typer.Option(8, "--chunk-size", help="Retrieval chunk size outside its sweep."),
    gamma1: int = typer.Option(2, "--gamma1"),
    gamma2: int = typer.Option(6, "--gamma2"),
    temperature: float = typer.Option(0.6, "--temperature", "-t", help="Temperature outside its sweep."),
    sinks: int = typer.Option(4, "--sinks", help="Attention sinks of the streaming policy."),
    gen_len: int = typer.Option(32, "--gen-len", help="Tokens generated per pg19 prompt."),
    needle_gen_len: int = typer.Option(0, "--needle-gen-len",
                                       help="Tokens generated per needle prompt (0: the key's length + 1)."),
    sweep_prompts: int = typer.Option(3, "--sweep-prompts", help="Prompts per task at each sweep point."),
    rebuild_every: int = typer.Option(128, "--rebuild-every", help="Re-select the middle cache every N tokens."),
    parts: str = typer.Option("all", "--parts", help="Measurements to run: all, or a comma-separated subset of "
                                                     "table1, budget, chunk_size, gamma2, gamma1, temperature, speed."),
    reuse_prefill: bool = flag("--reuse-prefill", "Prefill each prompt once and reuse its KV cache for every "
                                                  "other setting (a KV snapshot per prompt in a temporary folder: "
                                                  "disk for the full KV cache of every prompt)."),
    seed: int = typer.Option(0, "--seed"),
    out: str = typer.Option("eval-out", "--out", help="Folder for results.json, results.md and the PNGs."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | float16 | bfloat16"),
    weights: str = o.WEIGHTS,
    as_json: bool = flag("--json", "Print the results as one JSON object."),
) -> None:
    """Acceptance of Top-K, StreamingLLM, H2O and retrieval caches at the same budget (Table 1, Fig. 5/6)."""
    def body():
        from ..eval import run as E

        tasks = list(E.TASKS) if task == "both" else [task]
        if any(t not in E.TASKS for t in tasks):
            raise UsageError(f"--task must be pg19, needle or both, got {task!r}")
        chosen = list(E.PARTS) if parts.strip() == "all" else [x.strip() for x in parts.split(",") if x.strip()]
        if not chosen or any(x not in E.PARTS for x in chosen):
            raise UsageError(f"--parts must be all or a comma-separated subset of {', '.join(E.PARTS)}, got {parts!r}")
        names = [p.strip() for p in policies.split(",") if p.strip()]
        bad = [p for p in names if p not in POLICIES]
        if bad or not names:
            raise UsageError(f"--policies: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(POLICIES)}")
        if dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        cfg = E.EvalConfig(tasks=tasks, contexts=_list(context, int, "context"), policies=names,
                           budgets=_list(budgets, int, "budgets"), chunk_sizes=_list(chunk_sizes, int, "chunk-sizes"),
                           gamma1s=_list(gamma1s, int, "gamma1s"), gamma2s=_list(gamma2s, int, "gamma2s"),
                           temperatures=_list(temperatures, float, "temperatures"), gen_len=gen_len, needle_gen_len=needle_gen_len,
                           budget=budget,
                           chunk_size=chunk_size, gamma1=gamma1, gamma2=gamma2, temperature=temperature,
                           sinks=sinks, sweep_prompts=sweep_prompts, rebuild_every=rebuild_every, seed=seed,
                           parts=chosen, reuse_prefill=reuse_prefill)
        if gen_len < 1 or sweep_prompts < 1 or needle_gen_len < 0 or min(cfg.contexts) < 2:
            raise UsageError("--gen-len and --sweep-prompts must be >= 1, --needle-gen-len >= 0 and "
                             "--context lengths >= 2")
        for b in cfg.budgets + [budget]:
            for g1 in cfg.gamma1s + [gamma1]:
                for g2 in cfg.gamma2s + [gamma2]:
                    Speculation(method="retrieval", budget=b, chunk_size=min(chunk_size, b), gamma1=g1, gamma2=g2,
                                sinks=sinks, rebuild_every=rebuild_every).validate()
        for t in cfg.temperatures + [temperature]:
            Sampling(temperature=t).validate()
        pattern = books or os.environ.get("TFORCE_BOOKS")
        if not pattern:
            raise UsageError("--books: give a glob of plain-text books (e.g. Project Gutenberg .txt files), "
                             "or set TFORCE_BOOKS")
        files = sorted(glob.glob(str(Path(pattern).expanduser())))
        if not files:
            raise UsageError(f"--books {pattern!r} matches no files")
        if Path(out).expanduser().exists() and not Path(out).expanduser().is_dir():  # before the work, not after
            raise UsageError(f"--out {out}: a file, not a folder")
        cfg.books = [Path(f).stem for f in files]
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
        set_threads(threads)
        from ..model.quant import check_weights

        check_weights(weights)
        dev = pick_device(device)
        from ..model.weights import load_model

        torch_dtype = None if dtype == "auto" else dtype
        loaded = load_model(model, device=dev, dtype=torch_dtype, weights=weights)
        context_max = loaded.config.max_position_embeddings
        longest = max(cfg.contexts) + max(cfg.gen_len, cfg.needle_gen_len)
        if longest > context_max:  # generation would stop early at the context's end, unlike the rest
            raise UsageError(f"--context {max(cfg.contexts)} + --gen-len {max(cfg.gen_len, cfg.needle_gen_len)} "
                             f"exceeds the model's context ({context_max} tokens)")
        draft_name = draft if draft is not None else default_draft(model)
        if draft_name == LOOKUP:  # no draft model: triforce's bottom level proposes by n-gram lookup
            cfg.proposer = "lookup"
        small = None if draft_name in (None, LOOKUP) else load_model(draft_name, device=dev, dtype=torch_dtype,
                                                                      tokenizer=False).model
        if draft_name is None:
            say("tforce: eval: no draft model: the gamma1 sweep is skipped, speed compares ar with retrieval")
        res = E.evaluate(loaded.model, small, loaded.tokenizer, texts, cfg,
                         progress=lambda line: say(f"tforce: eval: {line}"))
        res["model"], res["draft"] = model, draft_name
        written = E.write(res, Path(out), title=f"tforce eval: {model}")
        say(f"tforce: eval: {res['runs']} runs ({res['prefills']} prefills) in {res['wall_s']:.0f} s; wrote {', '.join(written)} to {out}")
        if as_json:
            sys.stdout.write(json.dumps(res) + "\n")
        else:
            sys.stdout.write(E.markdown(res, f"tforce eval: {model}") + "\n")
        sys.stdout.flush()

    guarded(body)
