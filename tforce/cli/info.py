"""`tforce info`: versions, devices, memory; a model's KV-cache placement plan and its s/token floor."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from .. import cpu_features
from ..config import Speculation
from ..errors import UsageError
from .app import app
from .common import DTYPES, OFFLOAD_HELP, guarded, parse_placement, flag


def _arch(config, context: int, dtype: str) -> dict:
    import torch

    from ..model import families

    heads, kv_heads, head_dim = config.num_attention_heads, families.kv_heads(config), families.head_dim(config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * elem  # keys and values, every layer
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": config.vocab_size,
        "context": config.max_position_embeddings,
        "rope_type": rope_type,
        "rope_theta": rope.get("rope_theta", getattr(config, "rope_theta", None)),
        "synthetic": bool(getattr(config, "tforce_synthetic", False)),
        "kv_dtype": dtype,
        "kv_bytes_per_token": per_token,
        "kv_context": context,
        "kv_bytes_for_context": per_token * context,
    }


def _info_plan(config, context: int, dtype: str, budget: int, host_free: int, offload: str,
               gpu_memory: Optional[int], world: int, rows: int = 1, draft_config=None, weights: str = "auto",
               proposer: str = "model") -> dict:
    """The plan for GPU 0 as it is (its memory, capped by --gpu-memory; the CUDA context measured), or on
    paper for a GPU of --gpu-memory bytes (the context a named constant; flash-attn assumed). Without
    flash-attn on a CUDA machine, SDPA's memory-efficient backend (placement.Work.attention). proposer:
    triforce's bottom level, "lookup" planning no draft model."""
    import torch

    from ..engine import placement
    from ..model.attention import flash_attn_func
    from ..bench.suite import info_plan
    from ..bench.ceilings import device_bandwidth_gbps, h2d_peak_gbps

    cuda = torch.cuda.is_available()
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    gpu_budget, context_bytes, attention = gpu_memory, placement.CONTEXT_BYTES, "flash"
    if cuda:
        free, total = torch.cuda.mem_get_info(0)
        context_bytes = total - free - torch.cuda.memory_reserved(0)
        gpu_budget = total if gpu_memory is None else min(total, gpu_memory)
        attention = "flash" if flash_attn_func is not None and dtype != "float32" else "sdpa"
    elif gpu_memory is None:
        context_bytes, attention = 0, "math"  # no device: the plan for the CPU
    h2d, dev = (h2d_peak_gbps("cuda:0"), device_bandwidth_gbps("cuda:0")) if cuda else (None, None)
    return {"h2d_gbps": h2d, "device_gbps": dev, "offload": offload, "context_measured": cuda,
            **info_plan(config, context, elem, gpu_budget, host_free, offload, budget, h2d, dev, world,
                        draft_config=draft_config, context_bytes=context_bytes, attention=attention, rows=rows,
                        weights=weights, spec=Speculation(budget=budget, proposer=proposer))}


def _threads_now() -> dict:
    """The thread count a run started now would begin with (threads.py), from one look at the load."""
    from ..threads import look

    seen = look()
    return {"threads": seen.free_cores, "cores": seen.cores,
            "others_busy_cores": None if seen.others is None else round(seen.others, 2)}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@app.command()
def info(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Also describe this model (config only)."),
    synthetic: Optional[str] = typer.Option(None, "--synthetic", help="... or this architecture (bench's "
                                                                       "--synthetic names)."),
    context: Optional[int] = typer.Option(None, "--context", help="Context length for the KV-cache size "
                                                                  "(default: the model's own context)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="KV-cache dtype: float32 | float16 | bfloat16"),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="GPU memory to plan for (default: "
                                                                         "the free memory of GPU 0)."),
    offload: str = typer.Option("auto", "--offload", help=OFFLOAD_HELP),
    budget: int = typer.Option(Speculation.budget, "--budget", help="Retrieval cache size (resident beside the "
                               "full cache)."),
    ranks: int = typer.Option(1, "--gpus", help="Plan one rank of the target split over N GPUs (tensor "
                                               "parallelism: half the KV heads each for 2)."),
    batch: int = typer.Option(1, "--batch", help="Plan this many sequences of --context tokens decoded together."),
    weights: str = typer.Option("auto", "--weights", help="Plan the layers' projections as int8 or int4 "
                                "(as --weights quantizes them at load), else in --dtype."),
    as_json: bool = flag("--json", "Print one JSON object."),
) -> None:
    """Versions, devices, host memory, measured H2D bandwidth and (with --model or --synthetic) the model's
    shape, KV-cache size, placement plan and the s/token floor of plain offloaded decoding."""
    def body():
        import platform

        import psutil
        import torch
        import transformers

        from ..version import __version__

        if context is not None and context <= 0:
            raise UsageError(f"--context must be positive, got {context}")
        if ranks < 1:
            raise UsageError(f"--gpus must be >= 1, got {ranks}")
        if batch < 1:
            raise UsageError(f"--batch must be >= 1, got {batch}")
        from ..model.quant import check_weights

        check_weights(weights)
        if dtype not in DTYPES[1:]:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES[1:])}, got {dtype!r}")
        if model is not None and synthetic is not None:
            raise UsageError("give --model or --synthetic, not both")
        if model is None and synthetic is None:  # ignored, they would read as a plan that fits
            given = [name for name, v in (("--context", context is not None), ("--gpu-memory", gpu_memory is not None),
                                          ("--gpus", ranks != 1), ("--batch", batch != 1)) if v]
            if given:
                raise UsageError(f"{given[0]} plans a model: give --model or --synthetic ARCH")
        placement_options = parse_placement(offload, gpu_memory)
        gpus = [{"name": torch.cuda.get_device_name(i),
                 "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        mem = psutil.virtual_memory()
        record = {"tforce": __version__, "python": platform.python_version(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "cpu_cores": os.cpu_count(), "cpu_threads": _threads_now(),
                  "cpu": cpu_features.describe(),
                  "cuda_devices": gpus,
                  "host_memory_bytes": mem.total, "host_memory_available_bytes": mem.available}
        draft_config, proposer = None, "model"  # the paper's 68M draft, unless run's default draft is a local folder
        if model is not None:
            from ..model.registry import LOOKUP, resolve
            from ..model.weights import read_config
            from .setup import default_draft

            path = resolve(model, weights=False)  # from the hub: config and tokenizer files, no weights
            config = read_config(path)
            draft = default_draft(model)
            if draft == LOOKUP:  # no draft model (registry.py)
                proposer = "lookup"
            elif draft is not None and Path(draft).is_dir():
                draft_config = read_config(Path(draft))
            record["model"] = {"name": model, "path": str(path), "planned_from": "config.json",
                               **_arch(config, context or config.max_position_embeddings, dtype), **_prompt(path, config),
                               "quantized": _quantized(path)}
            if record["model"]["quantized"]:  # a converted GGUF: what its weights take on disk, as loaded
                record["model"]["weights_file_bytes"] = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        if synthetic is not None:
            from ..model.synthetic import ARCHITECTURES, make_config

            if synthetic not in ARCHITECTURES:
                raise UsageError(f"--synthetic must be one of {', '.join(ARCHITECTURES)}, got {synthetic!r}")
            config = make_config(synthetic)
            record["model"] = {"name": f"synthetic:{synthetic}", "path": None,
                               **_arch(config, context or config.max_position_embeddings, dtype)}
        if "model" in record:
            from ..model.sharding import check_tp

            check_tp(config, ranks)
            record["plan"] = _info_plan(config, record["model"]["kv_context"], dtype, budget, mem.available,
                                        world=ranks, rows=batch, draft_config=draft_config, weights=weights,
                                        proposer=proposer, **placement_options)
        if as_json:
            sys.stdout.write(json.dumps(record) + "\n")
            return
        _print_info(record)

    guarded(body)


def _quantized(path) -> dict:
    """A converted GGUF's stored projections, counted by what they became and from what: {"int4 (Q4_1,
    mapped)": 210, ...}; {} for a folder that stores none."""
    from ..model.quant_stored import read_quantized

    counts: dict = {}
    for info in read_quantized(path).values():
        key = f"{info['scheme']} ({info['source']}, {info['how']})"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _prompt(path, config) -> dict:
    """How run and chat lay out a prompt for this model (text/format.py) and the ids they stop at
    (config.json's and generation_config.json's, weights.py)."""
    from ..engine.generate import eos_ids
    from ..model.weights import load_tokenizer

    tok = load_tokenizer(path)
    return {"tokenizer": tok is not None, "chat_template": bool(getattr(tok, "chat_template", None)),
            "eos_token_ids": sorted(eos_ids(config))}


def _print_info(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("tforce", r["tforce"])
    t.add_row("python / torch / transformers", f"{r['python']} / {r['torch']} / {r['transformers']}")
    t.add_row("cpu cores", str(r["cpu_cores"]))
    bf16 = {True: "native (AVX512-BF16, AMX or Arm BF16)", False: "emulated (no bfloat16 instructions)",
            None: "unknown"}[r["cpu"]["bf16_native"]]
    t.add_row("cpu kernels", f"{r['cpu']['capability']}; bfloat16 {bf16}")
    gpus = ", ".join(f"{g['name']} ({_gib(g['memory_bytes'])})" for g in r["cuda_devices"]) or "none"
    c = r["cpu_threads"]
    seen = "" if c["others_busy_cores"] is None else f" (other processes keep {c['others_busy_cores']:.1f} busy now)"
    t.add_row("cpu threads", f"a run starting now: {c['threads']} of {c['cores']} cores{seen}; without --threads, "
                             "followed while decoding")
    t.add_row("cuda devices", gpus)
    t.add_row("host memory", f"{_gib(r['host_memory_bytes'])} ({_gib(r['host_memory_available_bytes'])} available)")
    m = r.get("model")
    if m:
        where = f" ({m['path']})" if m["path"] else ""
        t.add_row("model", f"{m['name']}{where}" + ("  [RANDOM WEIGHTS]" if m["synthetic"] else ""))
        if m.get("planned_from"):
            t.add_row("planned from", "the model's config.json, not its weights (neither downloaded nor read)")
        if m.get("quantized"):
            t.add_row("stored projections", ", ".join(f"{n} {k}" for k, n in m["quantized"].items())
                      + "; kept so on the CPU and CUDA (int4 from compute capability 8.0), dequantized into "
                        f"the dtype elsewhere; weights {_gib(m['weights_file_bytes'])} on disk")
        t.add_row("architecture", f"{m['model_type']}: {m['layers']} layers, hidden {m['hidden_size']}, "
                                  f"{m['heads']} heads, {m['kv_heads']} kv heads, head dim {m['head_dim']}")
        t.add_row("context / rope", f"{m['context']} tokens, rope {m['rope_type']} (theta {m['rope_theta']})")
        t.add_row("kv cache", f"{m['kv_bytes_per_token']} bytes/token ({m['kv_dtype']}); "
                              f"{_gib(m['kv_bytes_for_context'])} for {m['kv_context']} tokens")
        if "chat_template" in m:
            layout = "the tokenizer's chat template (--template none: the text as it is)" if m["chat_template"] \
                else "the text as it is (no chat template)" if m["tokenizer"] else "no tokenizer"
            t.add_row("prompt / stops at", f"{layout}; end-of-sequence ids {m['eos_token_ids']}")
    p = r.get("plan")
    if p:
        _plan_rows(t, p)
    Console().print(t)


_PHASES = {"both": "prefill and decode", "prefill": "prefill", "decode": "decode"}


def _plan_rows(t, p: dict) -> None:
    def rate(x):
        return "unmeasured (no CUDA GPU)" if x is None else f"{x:.1f} GB/s"

    def secs(x):
        return "unmeasured" if x is None else f"{x:.4f} s/token"

    budget = "no GPU (plan for the CPU)" if p["gpu_budget_bytes"] is None else _gib(p["gpu_budget_bytes"])
    ranks = f" per rank of {p['ranks']}" if p["ranks"] > 1 else ""
    t.add_row("H2D (pinned) / device memory", f"{rate(p['h2d_gbps'])} / {rate(p['device_gbps'])}")
    t.add_row("placement budget", f"GPU {budget}{ranks}; weights {_gib(p['weights_bytes'])}; offload {p['offload']}")
    if "error" in p:
        t.add_row("placement plan", f"does not fit: {p['error']}")
        return
    host = "" if p["host_fits"] else f"  (host memory too small: {_gib(p['host_available_bytes'])} available)"
    tokens = f"{p['rows']} x {p['context']}" if p["rows"] > 1 else f"{p['context']}"
    t.add_row("placement plan", f"KV cache: {_gib(p['kv_bytes'])} for {tokens} tokens, {p['describe']}{host}")
    context = "measured" if p["context_measured"] else "estimate"
    t.add_row("memory plan", f"device bytes{ranks}; attention {p['attention']}, CUDA context {context}")
    for item in p["items"]:
        t.add_row(f"  {item['name']}", f"{_gib(item['bytes'])}  ({_PHASES[item['phase']]})")
        if item["name"] == "retrieval chunk statistics" and p.get("recompute_stats"):
            t.add_row("", "not kept for the resident layers (no room): summed from their keys at each rebuild")
    t.add_row("  prefill peak", _gib(p["prefill_peak_bytes"]))
    t.add_row("  decode peak", _gib(p["decode_peak_bytes"]))
    t.add_row("  budget", budget)
    t.add_row("pinned host memory", f"{_gib(p['host_pinned_bytes'])}{ranks}")
    step = f" (a step: one token of each of {p['rows']} rows)" if p["rows"] > 1 else ""
    t.add_row(f"floor, plain offloaded decoding{step}",
              f"{secs(p['floor_s_per_token'])} = KV over H2D {secs(p['floor_h2d_s_per_token'])} "
              f"+ weights and resident KV from device memory {secs(p['floor_device_s_per_token'])}")


# -------------------------------------------------------------------------------------------- bench
