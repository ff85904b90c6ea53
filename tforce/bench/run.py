"""One timed run of one method for `tforce bench` (bench/suite.py runs every method and reports): the bench's
configuration, the models it runs on (in this process or split over ranks), the warm-up, and a run's
record.

A run's record holds the quantities of docs/architecture.md, "Measurements": ms/token, acceptance per level,
tokens per full-cache verification, prefill seconds, seconds spent rebuilding the retrieval cache during
decoding (and how many rebuilds), the achieved host-to-device rate of the offloaded KV stream against the
measured pinned-copy peak, GPU and pinned memory; bench/suite.py's report adds the speed-up over `ar` on the
same engine and placement. Each run also carries its stage times (seconds in each level's forwards) and a
projection: the ms/token those stage times give at an assumed acceptance rate (projection.py; default the
paper's 0.92 at every level), which is what a synthetic run can say about a trained pair. A projection is not a
measurement.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from ..model import families
from ..engine import placement
from .ceilings import Ceilings
from .. import threads
from ..config import RunConfig, Speculation
from ..engine.events import Events
from .floors import prefill_flops, step_floors_ms
from ..model.quant import weight_bytes
from ..auto.projection import project

GiB = placement.GiB


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
    weights: str = "auto"  # the target's projections: as loaded, or quantized (model/quant.py)


DETERMINISTIC = "+det"  # method suffix: the same method with row-wise verification (rowwise.py)


def split_method(name: str) -> tuple[str, bool]:
    """'triforce+det' -> ('triforce', True): the engine's method and its deterministic flag."""
    return (name[:-len(DETERMINISTIC)], True) if name.endswith(DETERMINISTIC) else (name, False)


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os

    return f"cpu ({os.cpu_count()} cores)"


@dataclass
class Models:
    """What bench times: a target and draft in this process, or (world > 1) checkpoint folders that
    tforce.parallel.tp.generate_tp splits over `world` ranks, fresh worker processes per generation."""

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
        n_kv, d = families.kv_heads(config), families.head_dim(config)
        elem = torch.empty((), dtype=dtype).element_size()
        return cls(torch.device(device, 0) if device == "cuda" else torch.device(device), dtype,
                   2 * (n_kv // world) * d * elem, target_path=target_path, draft_path=draft_path,
                   world=world)

    def generate(self, ids: list[int], method: str, config: RunConfig):
        """One run of `method` (it may end in +det) with the bench's configuration."""
        method, deterministic = split_method(method)
        config = config.with_options(method=method, deterministic=deterministic)
        uses_draft = method == "auto" or config.speculation.uses_draft
        if self.world == 1:
            from ..auto.chooser import generate  # the engine's, with "auto" resolved first

            return generate(self.target, ids, config, draft=self.draft if uses_draft else None, events=STEP)
        from ..parallel.tp import generate_tp

        record = None
        if method == "auto":  # each rank would time its own share: no calibration (chooser.uncalibrated)
            from ..auto.chooser import uncalibrated

            bottom = self.draft_path is not None or config.speculation.proposer == "lookup"
            config = config.with_options(method=uncalibrated(self.device.type, bottom))
            uses_draft, record = config.speculation.uses_draft, {"method": config.method, "calibrated_now": False}
            if config.speculation.looks_up:
                record["proposer"] = "lookup"
        result = generate_tp(self.target_path, self.draft_path if uses_draft else None, ids, self.world,
                             self.device.type, self.dtype, config)
        if record is not None:
            result.stats["auto"] = record
        return result


STEP = Events(on_step=threads.tick)  # the thread governor the command line chose, followed while decoding


def run_config(cfg: BenchConfig, max_new: int) -> RunConfig:
    """The configuration every run of the bench has (the method apart), max_new tokens each."""
    return RunConfig.of(max_new_tokens=max_new, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                        ignore_eos=True, offload=cfg.offload, gpu_memory=cfg.gpu_memory, **cfg.engine)


WARMUP_TOKENS = 256  # prompt tokens of the warm-up generations


def warm_up(models: Models, ids: list[int], cfg: BenchConfig) -> float | None:
    """A short generation per method (first WARMUP_TOKENS prompt tokens, 4 new ones) before anything is
    timed, so that one-time costs (kernel loading, allocator growth, thread pools) land in none of the runs.
    Returns its seconds, reported apart (docs/architecture.md, "Measurements"). None when split over ranks: every
    generation starts fresh worker processes, so nothing warm would carry over."""
    if models.world > 1:
        return None
    t0 = time.perf_counter()
    for method in cfg.methods:
        if split_method(method)[0] == "auto":  # its calibration warms up each method it times
            continue
        models.generate(ids[:WARMUP_TOKENS], method, run_config(cfg, 4))
    return time.perf_counter() - t0


def stage_floors(models: Models, spec: Speculation, n_prompt: int, n_out: int, s: dict, ceil: Ceilings) -> dict | None:
    """Each stage's measured ms per forward beside its floor (floors.py, at the rows its forwards fed on
    average: one for one prompt) and the difference (the overhead per forward), and the prefill's FLOP
    floor; n_out: one row's new tokens (the mean context is n_prompt + n_out / 2). None where the models
    live in other processes (their configs are not here)."""
    if models.target is None:
        return None
    config = models.target.config
    draft_config = models.draft.config if models.draft is not None else None
    elem = next(models.target.parameters()).element_size()
    rows = {name: s["row_forwards"][name] / n for name, n in s["forwards"].items() if n}
    read = weight_bytes(models.target) if getattr(models.target, "weights", "auto") != "auto" else None
    steps = step_floors_ms(config, draft_config, elem, spec, n_prompt + n_out / 2, ceil.device_gbps, rows,
                           target_weights=read)
    measured = {name: 1000 * s["stage_s"][name] / n for name, n in s["forwards"].items() if n}
    return {
        "step_ms": measured,
        "rows_per_forward": rows,
        "step_floor_ms": steps,
        # what a forward costs beyond reading its bytes: kernel launches, Python, small ops, compute
        "step_overhead_ms": None if steps is None else
        {name: ms - steps[name] for name, ms in measured.items() if name in steps},
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


def run_spec(cfg: BenchConfig, method: str, n_prompt: int, chosen: dict | None = None) -> Speculation:
    """The Speculation a run of `method` on an n_prompt-token prompt had (chosen: what auto ran), fitted as
    the Session fitted it."""
    from ..auto.chooser import options_of

    chose = options_of(chosen) if chosen else {"method": split_method(method)[0]}
    run = run_config(cfg, cfg.gen_len).with_options(**chose)
    return run.speculation.fitted(run.speculation.capacity(n_prompt + cfg.gen_len))


def run_one(models: Models, ids: list[int], method: str, cfg: BenchConfig,
            ceil: Ceilings) -> tuple[dict, list[int]]:
    """The run's record and its tokens."""
    h2d_peak = ceil.h2d_gbps
    device = models.device
    local_cuda = device.type == "cuda" and models.world == 1
    reset_peaks(device, local_cuda)
    result = models.generate(ids, method, run_config(cfg, cfg.gen_len))
    s = result.stats
    n = len(result.tokens)
    chosen = s.get("auto")  # what auto ran (chooser.Choice.record): the projection is that method's
    spec = run_spec(cfg, method, len(ids), chosen)
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
        "auto": chosen,
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
        "floors": stage_floors(models, spec, len(ids), n, s, ceil),
        "placement": {"resident_layers": s["kv_resident_layers"], "offloaded_layers": s["kv_offloaded_layers"],
                      "device_kv_gib": s["kv_device_bytes"] / GiB, "host_kv_gib": s["kv_host_bytes"] / GiB,
                      "chunk_stats_recomputed": s["kv_chunk_stats_recomputed"], "ranks": models.world},
    }, result.tokens
