"""`tforce bench` and the measurements behind `tforce info`: the logic; the CLI only parses and prints.

Per method, one `generate` over the same prompt with the same seed (ignore_eos), after a warm-up, timed
and recorded by bench/run.py (the quantities of docs/architecture.md, "Measurements", a projection at an assumed
acceptance rate); the report adds each method's speed-up over `ar` on the same engine and placement.

`--peers hf` adds transformers' own `generate` on the same weights and prompt (tforce/bench/peers.py), in
the record's "peers", each with its speed-up over `ar` and whether its greedy tokens equal `ar`'s.

Synthetic models (`--synthetic ARCH`) are built in memory with random weights (nothing is written to
disk) and every result from them carries "synthetic": true.
"""
from __future__ import annotations

import re

import torch

from .. import cpu_features
from ..engine import placement
from .run import DETERMINISTIC, WARMUP_TOKENS, BenchConfig, Models, device_name, run_one, split_method, warm_up
from .ceilings import Ceilings
from ..config import AUTO, METHODS, Speculation
from ..errors import TforceError, UsageError
from .floors import step_weight_bytes
from ..model.network import Llama
from ..model.synthetic import ARCHITECTURES, byte_tokenizer, make_config

# The small draft of each synthetic architecture: llama-68m's shape (JackFram/llama-68m) over the
# target's vocabulary; for `tiny`, a smaller tiny.
DRAFT_SHAPES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1),
}
LLAMA_68M = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                 num_key_value_heads=12)


def parse_methods(text: str) -> tuple[str, ...]:
    """Comma-separated methods, each optionally with the +det suffix (deterministic=True), ar first."""
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if split_method(m)[0] not in (AUTO,) + METHODS]
    if not names or bad:
        raise UsageError(f"--methods takes a comma-separated list of {', '.join((AUTO,) + METHODS)} (each may end in "
                         f"{DETERMINISTIC}: verified row by row); got {text!r}")
    ordered = tuple(dict.fromkeys(names))
    return ("ar",) + tuple(m for m in ordered if m != "ar") if "ar" in ordered else ordered  # ar first


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, option: str = "--gpu-memory") -> int:
    """'24GiB', '24GB', '24000MiB', '24G' (binary), '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text or "")
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None or float(m.group(1)) <= 0:
        raise UsageError(f"{option}: cannot read {text!r} as a size (e.g. 24GiB, 24GB, 24000MiB)")
    return int(float(m.group(1)) * unit)


# ------------------------------------------------------------------------------------ synthetic models


def random_llama(config, device, dtype: torch.dtype, seed: int) -> Llama:
    """Our Llama with seeded random weights, allocated directly on `device` in `dtype` (no float32 copy,
    no checkpoint). Matrices get N(0, 1/fan_in) as in synthetic.make_checkpoint; norms get 1."""
    with torch.device("meta"):
        model = Llama(config).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5, generator=gen)
            else:
                p.fill_(1.0)
    return model.eval()


def synthetic_pair(arch: str, device, dtype: torch.dtype, seed: int = 0):
    """(target, draft) of random weights for a synthetic architecture; the draft shares the vocabulary."""
    if arch not in ARCHITECTURES:
        raise UsageError(f"--synthetic must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    target = random_llama(make_config(arch), device, dtype, seed)
    draft_cfg = make_config(arch, rope_scaling=None, **DRAFT_SHAPES.get(arch, LLAMA_68M))
    draft = random_llama(draft_cfg, device, dtype, seed + 1)
    return target, draft


def prompt_ids(n: int, vocab: int, tokenizer=None, text: str | None = None, seed: int = 0) -> list[int]:
    """`text` tokenized (repeated, then cut to n tokens), or n random ids from a fixed seed."""
    if text is not None:
        tok = tokenizer if tokenizer is not None else byte_tokenizer()  # byte ids fit every vocabulary
        ids = list(tok.encode(text))
        if not ids:
            raise UsageError("the prompt file holds no tokens")
        return (ids * (n // len(ids) + 1))[:n]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()  # 0-2: <unk>, <s>, </s> in our vocabularies


# ---------------------------------------------------------------------------------------------- runs


def bench(models: Models, ids: list[int], cfg: BenchConfig, synthetic: bool, model_name: str,
          progress=None, on_run=None) -> dict:
    """Every method of cfg over the same prompt; the one JSON object `tforce bench --json` prints.
    on_run(report) after each method: the report so far, "complete": false (tforce bench --record)."""
    device = models.device
    if progress:
        progress(f"measuring pinned host-to-device copies, device memory and matrix products on {device}"
                 if device.type == "cuda"
                 else "no CUDA device: no host-to-device figures; measuring the CPU's memory copies and matrix "
                      "products")
    ceil = Ceilings.measure(device, models.dtype)
    if progress:
        progress(f"warm-up: every method on the first {min(WARMUP_TOKENS, len(ids))} prompt tokens (not timed)"
                 if models.world == 1
                 else f"{models.world} ranks: fresh worker processes per method, no warm-up (cold runs)")
    warmup_s = warm_up(models, ids, cfg)
    head = {
        "device": device_name(device) + (f" x {models.world} ranks" if models.world > 1 else ""),
        "cpu": cpu_features.describe() if device.type == "cpu" else None,
        "h2d_peak_gbps": ceil.h2d_gbps,
        "device_gbps": ceil.device_gbps,
        "matmul_tflops": ceil.tflops,
        "synthetic": synthetic,
        "model": model_name,
        "dtype": str(models.dtype).removeprefix("torch."),
        "weights": cfg.weights,
        "prompt_tokens": len(ids),
        "gen_len": cfg.gen_len,
        "temperature": cfg.temperature,
        "offload": cfg.offload,
        "ranks": models.world,
        "warmup_s": warmup_s,
        "project": cfg.project,
        "methods": list(cfg.methods),
    }
    runs, outputs = [], {}
    for method in cfg.methods:
        if progress:
            progress(f"{method}: {len(ids)} prompt tokens, {cfg.gen_len} new tokens")
        record, outputs[method] = run_one(models, ids, method, cfg, ceil)
        runs.append(record)
        if on_run:
            on_run(_report(head, runs, [], complete=False))
    others = []
    if cfg.peers:
        from . import peers

        others = peers.run(models, ids, cfg, outputs.get("ar"), WARMUP_TOKENS, progress,
                           gguf=None if synthetic else _gguf(model_name))
    return _report(head, runs, others, complete=True)  # cpu_threads: the CLI adds threads.choice()


def _gguf(model_name: str):
    """The GGUF file the model was read from, or None."""
    from ..model.registry import gguf_file

    try:
        return gguf_file(model_name)
    except TforceError:
        return None


def _report(head: dict, runs: list[dict], others: list[dict], complete: bool) -> dict:
    """The report of the runs so far: speed-ups over ar (measured and projected) where ar has run."""
    ar = next((r["ms_per_token"] for r in runs if r["method"] == "ar"), None)
    for r in runs + others:
        r["speedup_vs_ar"] = ar / r["ms_per_token"] if ar and r["ms_per_token"] else None
    ar_projected = next((r["projection"]["ms_per_token"] for r in runs if r["method"] == "ar" and r["projection"]),
                        None)
    for r in runs:
        if r["projection"] is not None:
            r["projection"]["speedup_vs_ar"] = ar_projected / r["projection"]["ms_per_token"] if ar_projected \
                else None
    return {**head, "complete": complete, "runs": runs, "peers": others}


# ------------------------------------------------------------------------------------------ info plan


def info_plan(config, context: int, dtype_bytes: int, gpu_budget: int | None, host_free: int,
              offload: str = "auto", budget: int = Speculation.budget, h2d_gbps: float | None = None,
              device_gbps: float | None = None, world: int = 1, draft_config=None,
              context_bytes: int = placement.CONTEXT_BYTES, attention: str = "flash",
              method: str = "triforce", rows: int = 1, spec: Speculation | None = None,
              prefill_chunk: int = 512, weights: str = "auto") -> dict:
    """The memory plan of one rank (of `world`) for `rows` prompts of `context` tokens decoded together
    (`spec`, the run's own speculation options, else `method` with default options and `budget`; a draft,
    where the method uses one, replicated; weights: the projections' form, placement.weight_bytes), and the
    s/step floor of plain (autoregressive) offloaded decoding it implies: every step streams the offloaded KV
    over H2D and reads the weights and the resident KV from device memory. gpu_budget: device bytes for
    everything, the CUDA context (context_bytes) included. Unmeasured parts are None."""
    shape = placement.Shape.of(config, dtype_bytes, world, weights)
    if draft_config is None:
        draft_config = make_config("tiny", rope_scaling=None, **LLAMA_68M, vocab_size=config.vocab_size)
    draft = placement.Shape.of(draft_config, dtype_bytes)
    spec = spec if spec is not None else Speculation(method=method, budget=budget)
    work = placement.Work(context, context, spec.fitted(context), prefill_chunk, cuda_graphs=gpu_budget is not None,
                          attention=attention, rows=rows)
    layer = rows * placement.kv_layer_bytes(shape.kv_heads, shape.head_dim, context, dtype_bytes)
    record = {"context": context, "rows": rows, "ranks": world, "weights_bytes": shape.weights,
              "kv_bytes": shape.layers * layer, "gpu_budget_bytes": gpu_budget, "host_available_bytes": host_free}
    try:
        p = placement.plan(shape, work, offload, gpu_budget, 2**62, draft, context_bytes)  # host checked below
    except TforceError as e:
        record["error"] = str(e)
        return record
    record.update(p.as_dict())
    record.update(resident_layers=p.resident, offloaded_layers=p.offloaded, gpu_kv_bytes=p.gpu_bytes,
                  host_kv_bytes=p.host_bytes, host_fits=world * p.host_bytes <= host_free, describe=p.describe())
    h2d_s = p.host_bytes / (h2d_gbps * 1e9) if h2d_gbps else (0.0 if p.host_bytes == 0 else None)
    read = step_weight_bytes(config, dtype_bytes, world) + p.resident * layer
    dev_s = read / (device_gbps * 1e9) if device_gbps else None
    record.update(floor_h2d_s_per_token=h2d_s, floor_device_s_per_token=dev_s,
                  floor_s_per_token=h2d_s + dev_s if h2d_s is not None and dev_s is not None else None)
    return record
