"""`tforce bench` and the measurements behind `tforce info`: the logic; the CLI only parses and prints.

Per method, one `generate` over the same prompt with the same seed (ignore_eos), and the roofline
quantities of DESIGN.md habit 9: ms/token, speed-up over `ar` on the same engine and placement,
acceptance per level, tokens per full-cache verification, prefill seconds, seconds spent rebuilding the
retrieval cache during decoding (and how many rebuilds), the achieved host-to-device
rate of the offloaded KV stream against the measured pinned-copy peak, GPU and pinned memory.

Each run also carries its stage times (seconds in each level's forwards) and a projection: the ms/token
those stage times give at an assumed acceptance rate (projection.py; default the paper's 0.92 at every
level), which is what a synthetic run can say about a trained pair. A projection is not a measurement.

`--peers hf` adds transformers' own `generate` on the same weights and prompt (tforce/peers.py), in
the record's "peers", each with its speed-up over `ar` and whether its greedy tokens equal `ar`'s.

Synthetic models (`--synthetic ARCH`) are built in memory with random weights (nothing is written to
disk) and every result from them carries "synthetic": true.
"""
from __future__ import annotations

import gc
import re
import time
from dataclasses import dataclass, field

import torch

from . import placement
from .config import METHODS, Speculation
from .errors import TforceError, UsageError
from .model import Llama
from .ceilings import Ceilings
from .floors import prefill_flops, step_floors_ms, step_weight_bytes
from .projection import project
from .synthetic import ARCHITECTURES, byte_tokenizer, make_config

GiB = placement.GiB

# The small draft of each synthetic architecture: llama-68m's shape (JackFram/llama-68m) over the
# target's vocabulary; for `tiny`, a smaller tiny.
DRAFT_SHAPES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1),
}
LLAMA_68M = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                 num_key_value_heads=12)


@dataclass
class BenchConfig:
    """Built once at the edge (the CLI) and passed down."""

    methods: tuple[str, ...] = ("ar", "triforce", "naive", "retrieval", "streaming")
    prompt_len: int = 122880
    gen_len: int = 256
    temperature: float = 0.6
    top_p: float = 0.9
    seed: int = 0
    offload: str = "auto"
    gpu_memory: int | None = None
    engine: dict = field(default_factory=dict)  # budget, gamma1, gamma2, draft_budget, chunk_size, ...
    peers: tuple[str, ...] = ()  # peers.FAMILIES' members: transformers' generate, timed beside the methods
    # acceptance at which each run's stage times are projected (projection.py); "measured": the run's own
    project: float | str = 0.92


DETERMINISTIC = "+det"  # method suffix: the same method with row-wise verification (rowwise.py)


def split_method(name: str) -> tuple[str, bool]:
    """'triforce+det' -> ('triforce', True): the engine's method and its deterministic flag."""
    return (name[:-len(DETERMINISTIC)], True) if name.endswith(DETERMINISTIC) else (name, False)


def parse_methods(text: str) -> tuple[str, ...]:
    """Comma-separated methods, each optionally with the +det suffix (deterministic=True), ar first."""
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if split_method(m)[0] not in METHODS]
    if not names or bad:
        raise UsageError(f"--methods takes a comma-separated list of {', '.join(METHODS)} (each may end in "
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


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os

    return f"cpu ({os.cpu_count()} cores)"


# ---------------------------------------------------------------------------------------------- runs


@dataclass
class Models:
    """What bench times: a target and draft in this process, or (world > 1) checkpoint folders that
    tforce.parallel.generate_tp splits over `world` ranks, fresh worker processes per generation."""

    device: torch.device
    dtype: torch.dtype
    kv_token_bytes: int  # K + V of one token in one layer of one rank's full cache
    target: object = None
    draft: object = None
    target_path: str | None = None
    draft_path: str | None = None
    world: int = 1

    @classmethod
    def local(cls, target, draft) -> "Models":
        p = next(target.parameters())
        return cls(p.device, p.dtype, 2 * target.n_kv_heads * target.head_dim * p.element_size(), target, draft)

    @classmethod
    def split(cls, config, target_path: str, draft_path: str | None, world: int, device: str,
              dtype: torch.dtype) -> "Models":
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        elem = torch.empty((), dtype=dtype).element_size()
        return cls(torch.device(device, 0) if device == "cuda" else torch.device(device), dtype,
                   2 * (n_kv // world) * head_dim * elem, target_path=target_path, draft_path=draft_path,
                   world=world)

    def generate(self, ids: list[int], method: str, **options):
        method, deterministic = split_method(method)
        options["deterministic"] = deterministic
        uses_draft = Speculation(method=method).uses_draft
        if self.world == 1:
            from .engine import generate

            return generate(self.target, ids, draft=self.draft if uses_draft else None, method=method, **options)
        from .parallel import generate_tp

        return generate_tp(self.target_path, self.draft_path if uses_draft else None, ids, self.world,
                           self.device.type, self.dtype, method=method, **options)


def _options(cfg: BenchConfig, max_new: int) -> dict:
    return dict(max_new_tokens=max_new, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                ignore_eos=True, offload=cfg.offload, gpu_memory=cfg.gpu_memory, **cfg.engine)


WARMUP_TOKENS = 256  # prompt tokens of the warm-up generations


def warm_up(models: Models, ids: list[int], cfg: BenchConfig) -> float | None:
    """A short generation per method (first WARMUP_TOKENS prompt tokens, 4 new ones) before anything is
    timed, so that one-time costs (kernel loading, allocator growth, thread pools) land in none of the runs.
    Returns its seconds, reported apart (DESIGN.md habit 9). None when split over ranks: every
    generation starts fresh worker processes, so nothing warm would carry over."""
    if models.world > 1:
        return None
    t0 = time.perf_counter()
    for method in cfg.methods:
        models.generate(ids[:WARMUP_TOKENS], method, **_options(cfg, 4))
    return time.perf_counter() - t0


def _floors(models: Models, spec: Speculation, n_prompt: int, n_out: int, s: dict, ceil: Ceilings) -> dict | None:
    """Each stage's measured ms per forward beside its floor (floors.py), and the prefill's FLOP floor;
    None where the models live in other processes (their configs are not here)."""
    if models.target is None:
        return None
    config = models.target.config
    draft_config = models.draft.config if models.draft is not None else None
    elem = next(models.target.parameters()).element_size()
    steps = step_floors_ms(config, draft_config, elem, spec, n_prompt + n_out / 2, ceil.device_gbps)
    return {
        "step_ms": {name: 1000 * s["stage_s"][name] / n for name, n in s["forwards"].items() if n},
        "step_floor_ms": steps,
        "prefill_flop_floor_s": prefill_flops(config, n_prompt) / (ceil.tflops * 1e12) if ceil.tflops else None,
    }


def reset_peaks(device: torch.device, cuda: bool) -> None:
    """Drop what earlier runs left and, with cuda, restart the device's peak-memory counts."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_record(device: torch.device, stats: dict, cuda: bool) -> dict:
    """A run's device memory since reset_peaks: the caching allocator's allocated and reserved peaks
    (torch.cuda.max_memory_*; None without cuda) beside the plan's predicted peak less the CUDA context
    (placement.py: the bytes the allocator should need at most, weights included; on a CPU run the plan's
    host-memory figure)."""
    return {
        "gpu_mem_gib": torch.cuda.max_memory_allocated(device) / GiB if cuda else None,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB if cuda else None,
        "planned_peak_gib": (stats["plan_peak_bytes"] - stats["plan_context_bytes"]) / GiB,
    }


def run_one(models: Models, ids: list[int], method: str, cfg: BenchConfig,
            ceil: Ceilings) -> tuple[dict, list[int]]:
    """The run's record and its tokens."""
    h2d_peak = ceil.h2d_gbps
    device = models.device
    local_cuda = device.type == "cuda" and models.world == 1
    reset_peaks(device, local_cuda)
    result = models.generate(ids, method, **_options(cfg, cfg.gen_len))
    s = result.stats
    n = len(result.tokens)
    spec = Speculation(method=split_method(method)[0],
                       **{k: v for k, v in cfg.engine.items() if k in Speculation.__dataclass_fields__})
    spec = spec.fitted(spec.capacity(len(ids) + cfg.gen_len))  # as the Session fitted it
    # Bytes of offloaded KV one rank streams per full-cache verification: only committed rows are
    # copied, so at the mean context length over the decode (about prompt + half the generated tokens).
    # The ranks stream in parallel, each over its own link: the achieved rate is their sum.
    mean_context = len(ids) + n / 2
    offloaded = s["kv_offloaded_layers"] * models.kv_token_bytes * mean_context
    streamed = offloaded > 0 and device.type == "cuda"
    h2d = models.world * offloaded * s["verifications"] / s["decode_s"] / 1e9 \
        if streamed and s["decode_s"] > 0 else None
    return {
        "method": method,
        "tokens": n,
        "ms_per_token": s["ms_per_token"],
        "speedup_vs_ar": None,
        "acceptance": s["acceptance"],
        "tokens_per_verification": s["tokens_per_verification"],
        "verifications": s["verifications"],
        "prefill_s": s["prefill_s"],
        "decode_s": s["decode_s"],
        "rebuild_s": s["rebuild_s"],  # retrieval rebuilds during decoding (within decode_s); None: no retrieval
        "rebuilds": s["rebuilds"],
        "prefill_rebuild_s": s["prefill_rebuild_s"],  # the initial one, within prefill_s
        "h2d_gbps": h2d,
        "h2d_bytes_per_verification": int(models.world * offloaded) if streamed else None,
        "floor_ms_per_verification": 1000 * offloaded / (h2d_peak * 1e9) if streamed and h2d_peak else None,
        **memory_record(device, s, local_cuda),
        "pinned_gib": models.world * s["kv_host_bytes"] / GiB,
        "forwards": s["forwards"],
        "stage_s": s["stage_s"],  # seconds in each node's forwards while decoding (within decode_s)
        # NOT measured: this run's stage times at an assumed acceptance (cfg.project) at every level
        "projection": project(s, spec, s["acceptance"] if cfg.project == "measured" else cfg.project),
        "floors": _floors(models, spec, len(ids), n, s, ceil),
        "placement": {"resident_layers": s["kv_resident_layers"], "offloaded_layers": s["kv_offloaded_layers"],
                      "device_kv_gib": s["kv_device_bytes"] / GiB, "host_kv_gib": s["kv_host_bytes"] / GiB,
                      "chunk_stats_recomputed": s["kv_chunk_stats_recomputed"], "ranks": models.world},
    }, result.tokens


def bench(models: Models, ids: list[int], cfg: BenchConfig, synthetic: bool, model_name: str,
          progress=None, on_run=None) -> dict:
    """Every method of cfg over the same prompt; the one JSON object `tforce bench --json` prints.
    on_run(report) after each method: the report so far, "complete": false (tforce bench --record)."""
    device = models.device
    if progress:
        progress(f"measuring pinned host-to-device copies, device memory and matrix products on {device}"
                 if device.type == "cuda"
                 else "no CUDA device: no host-to-device figures")
    ceil = Ceilings.measure(device, models.dtype)
    if progress:
        progress(f"warm-up: every method on the first {min(WARMUP_TOKENS, len(ids))} prompt tokens (not timed)"
                 if models.world == 1
                 else f"{models.world} ranks: fresh worker processes per method, no warm-up (cold runs)")
    warmup_s = warm_up(models, ids, cfg)
    head = {
        "device": device_name(device) + (f" x {models.world} ranks" if models.world > 1 else ""),
        "h2d_peak_gbps": ceil.h2d_gbps,
        "device_gbps": ceil.device_gbps,
        "matmul_tflops": ceil.tflops,
        "synthetic": synthetic,
        "model": model_name,
        "dtype": str(models.dtype).removeprefix("torch."),
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

        others = peers.run(models, ids, cfg, outputs.get("ar"), WARMUP_TOKENS, progress)
    return _report(head, runs, others, complete=True)


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
              offload: str = "auto", budget: int = 4096, h2d_gbps: float | None = None,
              device_gbps: float | None = None, world: int = 1, draft_config=None,
              context_bytes: int = placement.CONTEXT_BYTES, attention: str = "flash",
              method: str = "triforce", rows: int = 1) -> dict:
    """The memory plan of one rank (of `world`) for `rows` prompts of `context` tokens decoded together
    (`method` with default options; a draft, where the method uses one, replicated), and the s/step floor
    of plain (autoregressive) offloaded decoding it implies: every step streams the offloaded KV over H2D and
    reads the weights and the resident KV from device memory. gpu_budget: device bytes for everything, the CUDA context (context_bytes)
    included. Unmeasured parts are None."""
    shape = placement.Shape.of(config, dtype_bytes, world)
    if draft_config is None:
        draft_config = make_config("tiny", rope_scaling=None, **LLAMA_68M, vocab_size=config.vocab_size)
    draft = placement.Shape.of(draft_config, dtype_bytes)
    work = placement.Work.of(Speculation(method=method, budget=budget), context, context,
                             cuda_graphs=gpu_budget is not None, attention=attention, rows=rows)
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
