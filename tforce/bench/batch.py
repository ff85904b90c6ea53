"""`tforce bench --batch N`: N prompts as one batch (batch.generate_batch) against the same N prompts one
at a time (engine.generate), per method, on the same models, placement and options.

The prompts: N of --prompt-len tokens each, different texts (bench.prompt_ids with seeds seed, seed + 1,
...; a --prompt-file is cut at N different offsets). Decode seconds only (prefill is reported apart);
tokens/s counts every row's tokens. Greedy (temperature 0), the record also says whether every row
equals its prompt alone, token for token.
"""
from __future__ import annotations

import time

from ..engine.batch import generate_batch
from ..auto.projection import project
from ..engine.rates import decoded, rate
from .ceilings import Ceilings
from .suite import prompt_ids
from .run import (WARMUP_TOKENS, BenchConfig, Models, stage_floors, device_name, memory_record, reset_peaks,
                  STEP, run_config, run_spec, split_method)

DRAFTED = ("triforce", "naive", "streaming")  # the methods with a small draft (config.Speculation.uses_draft)


def batch_prompts(n_rows: int, length: int, vocab: int, tokenizer, text, seed: int) -> list[list[int]]:
    if text is None:
        return [prompt_ids(length, vocab, None, None, seed + i) for i in range(n_rows)]
    ids = prompt_ids(length * (n_rows + 1), vocab, tokenizer, text, seed)
    return [ids[i * length // 2: i * length // 2 + length] for i in range(n_rows)]


def run_batch(models: Models, prompts: list[list[int]], method: str, cfg: BenchConfig, ceil: Ceilings) -> dict:
    """method: an engine method, or one ending in +det (row-wise verification, in the batch and alone)."""
    engine_method, deterministic = split_method(method)
    draft = models.draft if engine_method in DRAFTED else None
    cuda = models.device.type == "cuda"
    reset_peaks(models.device, cuda)
    rows = generate_batch(models.target, prompts, run_config(cfg, cfg.gen_len), draft=draft, events=STEP,
                          method=engine_method, deterministic=deterministic)
    memory = memory_record(models.device, rows[0].stats, cuda)  # the batch's, before the one-at-a-time runs
    alone = [models.generate(p, method, run_config(cfg, cfg.gen_len)) for p in prompts]
    n = sum(len(r.tokens) for r in rows)
    batch_s, alone_s = rows[0].stats["decode_s"], sum(r.stats["decode_s"] for r in alone)
    # decoding's tokens: each row's first comes from its prefill (engine Session.round), outside decode_s
    n_decoded = sum(decoded(len(r.tokens)) for r in alone)
    spec, n_prompt = run_spec(cfg, method, max(map(len, prompts))), len(prompts[0])
    summed = {k: _summed([r.stats[k] for r in alone]) for k in ("forwards", "stage_s", "row_forwards")}
    summed.update(_run_totals(alone))
    return {
        "method": method,
        "rows": len(prompts),
        "tokens": n,
        "batch_tokens_per_s": rows[0].stats["batch_tokens_per_s"],  # decode_s's tokens over decode_s
        "ms_per_token": rows[0].stats["ms_per_token"],  # the batch's decode_s over the same tokens
        "one_at_a_time_tokens_per_s": rate(n_decoded, alone_s),
        "speedup_vs_one_at_a_time": alone_s / batch_s if batch_s > 0 else None,
        "batch_prefill_s": rows[0].stats["prefill_s"],
        "one_at_a_time_prefill_s": sum(r.stats["prefill_s"] for r in alone),
        # per node while decoding: the batch's forwards and their seconds, and the same summed over the prompts
        # run alone (what a row-forward costs in a batch against alone: stage_s / forwards)
        "forwards": rows[0].stats["forwards"], "stage_s": rows[0].stats["stage_s"],
        "one_at_a_time_forwards": summed["forwards"], "one_at_a_time_stage_s": summed["stage_s"],
        # each node's ms per forward beside its floor at the rows its forwards fed (run.py, floors.py): the
        # batch's reads the weights once for all rows a forward feeds, each row's KV
        "floors": stage_floors(models, spec, n_prompt, cfg.gen_len, rows[0].stats, ceil),
        "one_at_a_time_floors": stage_floors(models, spec, n_prompt, cfg.gen_len, summed, ceil),
        # NOT measured: the stage times above at an assumed acceptance (cfg.project) for the batch and alone
        "projection": _projection(rows, summed, spec, cfg.project),
        "acceptance": [r.stats["acceptance"] for r in rows],  # per row {"draft", "retrieval"}
        "tokens_per_verification": [r.stats["tokens_per_verification"] for r in rows],
        "rebuilds": [r.stats["rebuilds"] for r in rows],
        "prefill_rebuild_s": rows[0].stats["prefill_rebuild_s"],  # the batch's (all rows at once)
        "rebuild_s": rows[0].stats["rebuild_s"],  # all rows' rebuilds during decoding
        "rows_equal_alone": [r.tokens for r in rows] == [r.tokens for r in alone] if cfg.temperature == 0
        else None,
        "kv_offloaded_layers": rows[0].stats["kv_offloaded_layers"],
        **memory,  # gpu_mem_gib, gpu_reserved_gib, planned_peak_gib of the batch run
    }


def _run_totals(runs: list) -> dict:
    """decode_s and the retrieval rebuilds of several runs (or of a batch's rows, whose decode_s is one):
    the statistics projection.stage_costs reads, added up."""
    def total(key):
        return None if runs[0].stats[key] is None else sum(r.stats[key] for r in runs)

    return {"decode_s": sum(r.stats["decode_s"] for r in runs), "rebuild_s": total("rebuild_s"),
            "rebuilds": total("rebuilds"), "prefill_rebuild_s": total("prefill_rebuild_s")}


def _projection(rows: list, alone: dict, spec, at) -> dict:
    """The batch's and the prompts' alone decode projected at acceptance `at` (projection.py: the batch runs
    as many proposer rounds as its slowest row needs); "measured": the rows' mean acceptance per level."""
    if at == "measured":
        at = {level: _mean([r.stats["acceptance"][level] for r in rows]) for level in ("draft", "retrieval")}
    # the batch's stage times; its rebuild cost per row rebuilt (rows rebuilt together share one rebuild_s)
    batch = {**rows[0].stats, "rebuilds": _run_totals(rows)["rebuilds"]}
    together, apart = project(batch, spec, at, rows=len(rows)), project(alone, spec, at)
    return {"acceptance": at, "batch": together, "one_at_a_time": apart,
            "speedup_vs_one_at_a_time": apart["ms_per_token"] / together["ms_per_token"]
            if together and apart and together["ms_per_token"] else None}


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _summed(per_run: list[dict]) -> dict:
    """Per-node figures of several runs, added up by node name."""
    return {name: sum(d[name] for d in per_run) for name in per_run[0]}


def bench_batch(models: Models, prompts: list[list[int]], cfg: BenchConfig, synthetic: bool, model_name: str,
                progress=None, on_run=None) -> dict:
    """The one JSON object `tforce bench --batch N --json` prints; on_run(report so far, "complete": false)
    after each method (tforce bench --record)."""
    if progress:
        progress(f"warm-up: every method on {len(prompts)} prompts of {WARMUP_TOKENS} tokens (not timed)")
    t0 = time.perf_counter()
    for method, deterministic in map(split_method, cfg.methods):
        generate_batch(models.target, [p[:WARMUP_TOKENS] for p in prompts], run_config(cfg, 4), events=STEP,
                       draft=models.draft if method in DRAFTED else None, method=method, deterministic=deterministic)
    warmup_s = time.perf_counter() - t0
    ceil = Ceilings.measure(models.device, models.dtype)
    head = {"device": device_name(models.device), "synthetic": synthetic, "model": model_name,
            "dtype": str(models.dtype).removeprefix("torch."), "weights": cfg.weights, "batch": len(prompts),
            "prompt_tokens": len(prompts[0]), "gen_len": cfg.gen_len, "temperature": cfg.temperature,
            "offload": cfg.offload, "warmup_s": warmup_s, "methods": list(cfg.methods),
            "device_gbps": ceil.device_gbps, "matmul_tflops": ceil.tflops, "h2d_peak_gbps": ceil.h2d_gbps}
    runs = []
    for method in cfg.methods:
        if progress:
            progress(f"{method}: {len(prompts)} prompts of {len(prompts[0])} tokens, {cfg.gen_len} new tokens each, "
                     "as one batch and one at a time")
        runs.append(run_batch(models, prompts, method, cfg, ceil))
        if on_run and len(runs) < len(cfg.methods):
            on_run({**head, "complete": False, "runs": runs})
    return {**head, "complete": True, "runs": runs}
