"""`tforce bench`: the paper's measurements on the user's hardware (logic in tforce/bench/suite.py; the table in
bench_table.py)."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ..bench import record as bench_record
from ..config import METHODS, Sampling, Speculation
from ..model.defaults import default_pair, notice
from ..model.registry import LOOKUP
from ..text.demo import BENCH_TOKENS, EXCERPT, NAME
from ..errors import TforceError, UsageError
from . import options as o
from .app import app
from .bench_table import print_batch, print_bench
from .common import (DTYPES, as_role, check_memory, gpu_memory_note,
                     guarded, parse_placement, say, set_threads, flag)
from .setup import check_local, default_draft, read_draft_config, parallel_ranks, read_prompt, read_target

PROMPT_LEN = 122880  # the prompt of the paper's setups (README, "Reproducing the paper's setups")


@app.command()
def bench(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: a folder, hub id or short name "
                                                                    "(default without --synthetic: the demo pair, on "
                                                                    "the demo's excerpt)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Small draft model (default: the registry's, or the "
                                                               "sibling X-draft of a folder X-target), or `lookup`: "
                                                               "n-gram lookup, no model."),
    synthetic: Optional[str] = typer.Option(None, "--synthetic",
                                            help="Random weights of an architecture: llama2-7b | llama2-13b | "
                                                 "llama3.1-8b | tiny (results are labelled synthetic)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Split the target over N GPUs (--tp N --device "
                                                             "cuda; not with --synthetic)."),
    tp: int = o.TP,
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help=f"Prompt tokens (default {PROMPT_LEN}; "
                                                                        f"on the demo pair {BENCH_TOKENS})."),
    gen_len: int = typer.Option(256, "--gen-len", help="Tokens generated per method (EOS ignored)."),
    methods: Optional[str] = typer.Option(None, "--methods",
                                          help="Comma-separated (default: ar,triforce,naive,retrieval,streaming,auto; "
                                               "with --batch: ar,triforce,naive); auto: the method `tforce run` "
                                               "would choose (docs/auto.md); ar runs first and is the speed-up baseline; a "
                                               "method ending in +det (e.g. triforce+det) verifies row by row (run "
                                               "--deterministic)."),
    temperature: float = o.TEMPERATURE,
    top_p: float = o.TOP_P,
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f",
                                              help="A real text, tokenized and repeated/cut to --prompt-len "
                                                   "(default: random ids)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights, the prompt and sampling."),
    budget: int = o.BUDGET,
    chunk_size: int = o.CHUNK_SIZE,
    gamma1: int = typer.Option(Speculation.gamma1, "--gamma1", help="Draft tokens per middle-level verification."),
    gamma2: int = typer.Option(Speculation.gamma2, "--gamma2", help="Tokens per full-cache verification."),
    draft_budget: int = o.DRAFT_BUDGET,
    lookup_max: int = o.LOOKUP_MAX,
    lookup_min: int = o.LOOKUP_MIN,
    lookup_threshold: float = o.LOOKUP_THRESHOLD,
    prefill_chunk: int = o.PREFILL_CHUNK,
    device: str = o.DEVICE,
    threads: int = o.THREADS,
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | "
                                                      "float16 | bfloat16"),
    offload: str = o.OFFLOAD,
    gpu_memory: Optional[str] = o.GPU_MEMORY,
    weights: str = o.WEIGHTS,
    peers: Optional[str] = typer.Option(None, "--peers",
                                        help="hf: also time transformers' own generate on the same weights and "
                                             "prompt: plain, assisted by the draft, prompt lookup, offloaded "
                                             "cache (CUDA); greedy tokens checked against ar's. llama.cpp: "
                                             "llama-bench on the same GGUF at the same depth (CPU; "
                                             "$LLAMA_CPP_DIR or PATH). Both: 'hf,llama.cpp'."),
    batch: Optional[int] = typer.Option(None, "--batch", help="N prompts of --prompt-len tokens as one batch "
                                                               "against the same N one at a time."),
    project_at: str = typer.Option("0.92", "--project", metavar="ACCEPTANCE",
                                   help="Also project each run's ms/token at this acceptance rate at every "
                                        "level, from its measured stage times (shown for --synthetic, always "
                                        "in --json; default: the paper's 0.92; 'measured': each run's own "
                                        "acceptance, which checks the model). A projection, not a measurement."),
    as_json: bool = flag("--json", "Print one JSON object."),
    record_to: Optional[str] = typer.Option(None, "--record", metavar="FILE",
                                            help="Also write the JSON report to FILE after every method "
                                                 "(\"complete\": false until the last), so a run cut short "
                                                 "keeps the methods that finished."),
) -> None:
    """Time every method on one prompt: ms/token, speed-up over ar, acceptance, H2D GB/s, memory."""
    def body():
        from ..bench import suite as b
        from ..bench.peers import parse_peers

        if model is not None and synthetic is not None:
            raise UsageError("give --model or --synthetic ARCH, not both")
        demo = model is None and synthetic is None
        length = prompt_len if prompt_len is not None else BENCH_TOKENS if demo else PROMPT_LEN
        if length < 1 or gen_len < 1:
            raise UsageError(f"--prompt-len and --gen-len must be >= 1, got {length} and {gen_len}")
        if dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        default = "ar,triforce,naive" if batch is not None else "ar,triforce,naive,retrieval,streaming,auto"
        names = b.parse_methods(methods or default)
        if batch is not None:
            from ..engine.batch import check_batchable

            if batch < 1:
                raise UsageError(f"--batch must be >= 1, got {batch}")
            for name in names:
                check_batchable(name, det=True)
        peer_names = parse_peers(peers)
        set_threads(threads)
        engine = dict(budget=budget, chunk_size=chunk_size, gamma1=gamma1, gamma2=gamma2, draft_budget=draft_budget,
                      lookup_max=lookup_max, lookup_min=lookup_min, lookup_threshold=lookup_threshold)
        bottom = draft
        if bottom is None and synthetic is None:  # the model's own, which may be n-gram lookup (registry.py)
            bottom = default_pair()[1] if demo else default_draft(model)
        if bottom == LOOKUP:  # no draft model: the drafting methods propose by n-gram lookup
            engine["proposer"] = "lookup"
        draft_model = None if bottom == LOOKUP else draft
        for m in names:
            Speculation(method=b.split_method(m)[0], **engine).validate()
        if prefill_chunk < 1:
            raise UsageError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
        engine["prefill_chunk"] = prefill_chunk
        Sampling(temperature=temperature, top_p=top_p, seed=seed).validate()
        project = _project_option(project_at)
        from ..model.quant import SCHEMES, check_device, check_weights

        check_weights(weights)
        cfg = b.BenchConfig(methods=names, prompt_len=length, gen_len=gen_len, temperature=temperature,
                            top_p=top_p, seed=seed, engine=engine, peers=peer_names, project=project,
                            weights=weights, **parse_placement(offload, gpu_memory))
        text = None if prompt_file is None else read_prompt(prompt_file, None)
        world, dev = parallel_ranks(tp, gpus, device)
        if world > 1 and synthetic is not None:
            raise UsageError("--gpus/--tp > 1 needs --model (a checkpoint folder the ranks load); "
                             "--synthetic models are built in one process")
        if weights != "auto" and world > 1:
            raise UsageError(f"--weights {weights} runs in one process only, so far (no --tp/--gpus)")
        if weights in SCHEMES:
            check_device(weights, dev)
        if world > 1 and peer_names:
            raise UsageError("--peers runs in one process: drop --gpus/--tp")
        if batch is not None and (world > 1 or peer_names):
            raise UsageError("--batch runs in one process, without --peers, so far")
        target, small = model, draft_model
        if demo:  # as `tforce run` without --model: the demo pair, on its excerpt unless a prompt file is given
            target, demo_draft = default_pair()
            small = draft_model or (None if "proposer" in engine else demo_draft)
        excerpt = demo and prompt_file is None
        if excerpt:
            text = EXCERPT.read_text(encoding="utf-8").strip()
        gpu_memory_note(gpu_memory, dev)
        path = None if record_to is None else bench_record.check(record_to)

        def demo_notes() -> None:  # once the run is checked to fit: a refused one's error is the only line
            if demo:
                say(notice(target, bottom))
            if excerpt:
                say(f"tforce: bench: no --prompt-file given: timing {length} tokens of {NAME}")

        failed: list[str] = []  # a record write that failed (a full disk): the bench goes on

        def save(report: dict) -> None:
            try:
                bench_record.write(path, report)
            except OSError as e:
                failed.append(f"--record {record_to}: {e.strerror or e}")
                say(f"tforce: warning: {failed[-1]} (the bench goes on)")
            else:
                failed.clear()

        record = _bench(b, cfg, target, small, synthetic, dev, dtype, text, world, batch,
                        None if path is None else save, demo_notes, fit=prompt_len is None)
        from ..threads import choice

        record["cpu_threads"] = choice()
        if path is not None:
            save(record)
        if as_json:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()
        elif batch is not None:
            print_batch(record)
        else:
            print_bench(record)
        if failed:  # the report is out; the whole record is not in FILE
            raise TforceError(failed[-1])

    guarded(body)


def _check_room(cfg, context: int, fit: bool = False) -> None:
    """Refuse a prompt and generation longer than the model's context (generation would stop early: ms/token
    of fewer tokens). fit: the prompt's length is the default, not the user's: cut it to fit instead, and say so."""
    if cfg.prompt_len + cfg.gen_len > context and fit and context - cfg.gen_len >= 1:
        say(f"tforce: note: the model's context ({context} tokens) is shorter than the default --prompt-len "
             f"{cfg.prompt_len} + --gen-len {cfg.gen_len}: benchmarking prompts of {context - cfg.gen_len} tokens")
        cfg.prompt_len = context - cfg.gen_len
    if cfg.prompt_len + cfg.gen_len > context:
        raise UsageError(f"--prompt-len {cfg.prompt_len} + --gen-len {cfg.gen_len} exceeds the model's context "
                         f"({context} tokens)")


def _check_bench_memory(cfg, target_cfg, draft_cfg, torch_dtype, device: str, rows: int = 1) -> None:
    """Every method's run must fit, weights and caches, before anything is built (tforce info's plan)."""
    from ..bench.run import run_config
    from ..bench.suite import split_method

    methods = [split_method(m)[0] for m in cfg.methods]
    if "auto" in methods:  # its calibration runs every method it may choose
        proposer = cfg.engine.get("proposer", "model")  # lookup: every method runs without a draft model
        methods = [m for m in methods if m != "auto"] + [
            m for m in METHODS if draft_cfg is not None or not Speculation(method=m, proposer=proposer).uses_draft]
    for method in dict.fromkeys(methods):
        check_memory(target_cfg, draft_cfg, cfg.prompt_len + cfg.gen_len, torch_dtype.itemsize, device,
                      run_config(cfg, cfg.gen_len), method, rows)


def _bench(b, cfg, model: Optional[str], draft: Optional[str], synthetic: Optional[str], device: str,
           dtype: str, text: Optional[str], world: int = 1, batch: Optional[int] = None, on_run=None,
           on_checked=None, fit: bool = False) -> dict:
    """on_checked(): once the prompt and generation are checked to fit the model, before the first run.
    fit: --prompt-len was not given, so its default may be cut to what the model's context leaves."""
    import torch

    from ..model.synthetic import ARCHITECTURES, make_config

    lookup = cfg.engine.get("proposer") == "lookup"
    uses_draft = any(Speculation(method=b.split_method(m)[0], proposer=cfg.engine.get("proposer", "model")).uses_draft
                     for m in cfg.methods if b.split_method(m)[0] != "auto")
    auto = any(b.split_method(m)[0] == "auto" for m in cfg.methods)  # takes a draft where there is one
    if synthetic is not None:
        if synthetic not in ARCHITECTURES:
            raise UsageError(f"--synthetic must be one of {', '.join(ARCHITECTURES)}, got {synthetic!r}")
        torch_dtype = getattr(torch, dtype) if dtype != "auto" else (torch.bfloat16 if device == "cuda"
                                                                     else torch.float32)
        _check_room(cfg, ARCHITECTURES[synthetic]["max_position_embeddings"], fit)
        target_cfg = make_config(synthetic)
        draft_cfg = make_config(synthetic, **b.DRAFT_SHAPES.get(synthetic, b.LLAMA_68M)) if uses_draft or auto \
            else None
        _check_bench_memory(cfg, target_cfg, draft_cfg, torch_dtype, device, batch or 1)
        say(f"tforce: bench: building a random-weight {synthetic} target and draft on {device} (SYNTHETIC)")
        models = b.Models.local(*b.synthetic_pair(synthetic, device, torch_dtype, cfg.seed))
        if cfg.weights not in ("auto", "float"):
            from ..model.quant import quantize

            quantize(models.target, cfg.weights)
        config, tokenizer, name = models.target.config, None, f"synthetic:{synthetic}"
    else:
        from ..model.registry import resolve
        from ..model.weights import load_model

        check_local(model, "target model")  # the target first: a missing target folder is not a missing draft
        draft_name = draft if draft is not None or lookup else default_draft(model)
        if uses_draft and draft_name is None:
            raise UsageError("the methods need a draft model: pass --draft, or drop triforce, naive and streaming")
        # loaded also as hf-assisted's assistant when there is one
        uses_draft = draft_name is not None and (uses_draft or auto or "hf-assisted" in cfg.peers)
        torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
        if world > 1:  # the ranks load the weights: here only the config and tokenizer
            path, config, tokenizer = read_target(model, world)
            if uses_draft:
                read_draft_config(draft_name, config, tokenizer)
            torch_dtype = torch_dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
            models = b.Models.split(config, str(path), str(resolve(draft_name)) if uses_draft else None, world,
                                    device, torch_dtype)
        else:
            _, target_cfg, target_tok = read_target(model, 1)
            _check_room(cfg, target_cfg.max_position_embeddings, fit)
            draft_cfg = read_draft_config(draft_name, target_cfg, target_tok) if uses_draft else None
            _check_bench_memory(cfg, target_cfg, draft_cfg,
                                torch_dtype or (torch.bfloat16 if device == "cuda" else torch.float32), device,
                                batch or 1)
            loaded = as_role("target model", load_model, model, device=device, dtype=torch_dtype,
                              tokenizer=False, weights=cfg.weights)  # target_tok, read above
            small = as_role("draft model", load_model, draft_name, device=device, dtype=torch_dtype,
                             tokenizer=False).model if uses_draft else None
            models, config, tokenizer = b.Models.local(loaded.model, small), loaded.config, target_tok
        name = model
    context = config.max_position_embeddings
    _check_room(cfg, context, fit)
    if on_checked:
        on_checked()
    if batch is not None:
        from ..bench.batch import batch_prompts, bench_batch

        prompts = batch_prompts(batch, cfg.prompt_len, config.vocab_size, tokenizer, text, cfg.seed)
        return bench_batch(models, prompts, cfg, synthetic is not None, name,
                           progress=lambda line: say(f"tforce: bench: {line}"), on_run=on_run)
    ids = b.prompt_ids(cfg.prompt_len, config.vocab_size, tokenizer, text, cfg.seed)
    return b.bench(models, ids, cfg, synthetic is not None, name,
                   progress=lambda line: say(f"tforce: bench: {line}"), on_run=on_run)


def _project_option(text: str) -> float | str:
    if text == "measured":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise UsageError(f"--project must be an acceptance rate in [0, 1) or 'measured', got {text!r}")
    return value
