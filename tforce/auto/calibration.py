"""What each method's decode steps cost on this machine, measured by short runs at the prompt's length and
kept per machine, models, dtype, device and context in the user's cache (`--method auto`, chooser.py).

A calibration runs every candidate method on the prompt itself for CAL_TOKENS new tokens (after a
warm-up of WARMUP_NEW tokens on its first WARMUP_PROMPT tokens, which pays one-time costs outside the
timing) and keeps, per method, projection.stage_costs of the run (milliseconds per forward of each node,
of the rest of the loop per forward, of one retrieval rebuild), the ms/token it measured and the
acceptance per level at the gammas it ran with. Stage costs depend on the context's length, so an
entry holds for the prompts of one context bucket (CONTEXT_STEPS per doubling of the prompt's length).

An entry is one JSON file named by a digest of its key (`key`), written atomically (a temporary file
renamed into place, so a reader never sees half of one). It is measured again when it is missing,
older than STALE_AFTER_S, damaged (not JSON, a key that differs, a method's costs missing) or asked
for (`tforce tune`). After a run, the acceptance it measured is folded into its method's (`remember`),
so the next plan starts from what runs have seen, not from the calibration's few tokens alone.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from ..config import Speculation
from ..model.gguf import cache_root
from .projection import stage_costs

FORMAT = 1  # of an entry's JSON: a file of another format is re-measured
CAL_TOKENS = 16  # new tokens of each method's timed run
WARMUP_PROMPT, WARMUP_NEW = 64, 2
STALE_AFTER_S = 7 * 24 * 3600  # a week: drivers, thermal settings and neighbours change
CONTEXT_STEPS = 2  # context buckets per doubling of the prompt's length
MEMORY_TOKENS = 1024  # at most this many tokens' worth of past acceptance outweigh a new run's


SHARED_PREFILL_MAX_BYTES = 1 << 30  # a calibration keeps the prompt's prefill on disk up to this size


def shares_prefill(target, n_prompt: int) -> bool:
    """Whether a calibration's runs share one prefill of the prompt through a KV snapshot (chooser.choose):
    on the CPU, where a prefill costs seconds per thousand tokens and the target's KV cache of the prompt
    is at most SHARED_PREFILL_MAX_BYTES (written once, read by each other method and by the run)."""
    from ..engine.placement import Shape

    net = _network(target)
    p = next(net.parameters())
    if p.device.type != "cpu":  # a GPU prefills far faster than a disk writes and reads its KV cache back
        return False
    shape = Shape.of(net.config, p.element_size())
    return shape.layers * shape.layer_kv_per_token * n_prompt <= SHARED_PREFILL_MAX_BYTES


def cache_dir() -> Path:
    """Where entries are kept: the `auto` folder of tforce's cache ($TFORCE_CACHE, else the XDG cache)."""
    return cache_root() / "auto"


def context_bucket(n_prompt: int) -> int:
    """The bucket of a prompt of n_prompt tokens: floor(CONTEXT_STEPS * log2(n)), so 1,100 and 1,400
    tokens share one (20: 1,024 to 1,448) and 3,300 is another (23)."""
    return math.floor(CONTEXT_STEPS * math.log2(max(1, n_prompt)))


def fingerprint(model) -> str:
    """A digest of a network's config, a sample of its weights and how its projections are held (quant.py):
    the same checkpoint, whatever path or object it was loaded through, has the same one."""
    model = _network(model)
    first = next(model.parameters())
    sample = first.detach().flatten()[:256].float().cpu()
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    text = json.dumps(config, sort_keys=True, default=str) + repr(sample.tolist()) + str(sum(
        p.numel() for p in model.parameters())) + getattr(model, "weights", "auto")  # quantized: other costs
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _network(model) -> torch.nn.Module:
    """The network of a LoadedModel, or the network itself (which has a `model` attribute of its own)."""
    return model if isinstance(model, torch.nn.Module) else model.model


def machine() -> dict:
    """What makes this machine's timings its own."""
    from ..version import __version__

    return {"host": platform.node(), "arch": platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "tforce": __version__}


# The options that change what a step costs (or what is accepted); sampling's own are keyed as greedy or not.
COST_OPTIONS = ("budget", "chunk_size", "draft_budget", "sinks", "rebuild_every", "rebuild_below", "policy",
                "proposer", "lookup_max", "lookup_min", "lookup_threshold",
                "deterministic", "offload", "gpu_memory", "cuda_graphs")


def key(target, draft, n_prompt: int, config) -> dict:
    """The identity of an entry: machine, models, dtype, device, threads, context bucket, greedy or not, and
    the options (of config.RunConfig `config`) that change a step's cost."""
    options = config.options()
    p = next(_network(target).parameters())
    device = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "cpu"
    return {"format": FORMAT, **machine(), "device": device, "dtype": str(p.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "target": fingerprint(target),
            "draft": fingerprint(draft) if draft is not None else None, "context": context_bucket(n_prompt),
            "greedy": options.get("temperature", 0.6) == 0,
            **{name: options.get(name) for name in COST_OPTIONS}}


def path_of(k: dict, folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:24]
    return (folder or cache_dir()) / f"{digest}.json"


def read(k: dict, methods, folder: Path | None = None, now: float | None = None) -> dict | None:
    """The entry of key k if it is there, whole, of this key, fresh and holds every one of `methods`;
    else None (to be measured)."""
    try:
        entry = json.loads(path_of(k, folder).read_text())
        age = (time.time() if now is None else now) - entry["measured_at"]
        fresh = entry["key"] == k and 0 <= age <= STALE_AFTER_S
        whole = all(isinstance(entry["methods"][m]["costs"]["ms_per_forward"], dict) for m in methods)
        return entry if fresh and whole else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(entry: dict, folder: Path | None = None) -> Path:
    """Writes the entry atomically; returns its path. OSError when the cache cannot be written."""
    path = path_of(entry["key"], folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".entry-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def measure(run, methods, k: dict, gammas: dict) -> dict:
    """A new entry: run(method, prompt_len, new_tokens) -> engine.Result (the prompt's first prompt_len
    tokens, None: all) for each method; gammas: {"gamma1", "gamma2"} the runs use."""
    t0 = time.perf_counter()
    out = {}
    for method in methods:
        run(method, WARMUP_PROMPT, WARMUP_NEW)
        result = run(method, None, CAL_TOKENS)
        s = result.stats
        out[method] = {"costs": stage_costs(s), "ms_per_token": s["ms_per_token"], **gammas,
                       "acceptance": s["acceptance"], "tokens": len(result.tokens)}
    return {"key": k, "measured_at": time.time(), "calibration_s": time.perf_counter() - t0, "methods": out}


def remember(entry: dict, method: str, acceptance: dict, tokens: int, gammas: dict,
             folder: Path | None = None) -> None:
    """Folds a run's measured acceptance (its statistics' per level, at `gammas`) into its method's in the
    entry, a mean weighted by tokens (the past's weight capped at MEMORY_TOKENS), and writes the entry.
    Acceptance measured at other gammas than the entry's is converted first (projection.rate_at)."""
    from .projection import rate_at

    held = entry["methods"].get(method)
    if held is None or tokens <= 0:
        return
    past = min(held.get("tokens", 0), MEMORY_TOKENS)
    merged = {}
    for level, rate in acceptance.items():
        old = held["acceptance"].get(level)
        if rate is None or old is None:
            merged[level] = old
            continue
        g_old, g_new = level_gamma(method, level, held), level_gamma(method, level, gammas)
        rate = rate_at(rate, g_new, g_old)
        merged[level] = (old * past + rate * tokens) / (past + tokens)
    held["acceptance"] = merged
    held["tokens"] = past + tokens
    write(entry, folder)


def level_gamma(name: str, level: str, gammas: dict) -> int:
    """The gamma of the level the statistics call `level` ("draft": verifying the bottom level; "retrieval":
    verifying the middle level) in the entry's method `name`: gamma1 where the bottom level feeds a middle
    level, else gamma2."""
    method = split(name)[0]
    return gammas["gamma1"] if level == "draft" and Speculation(method=method).two_verifiers else gammas["gamma2"]


# An entry's method ending in LOOKED runs that method with n-gram lookup at its bottom level where the run
# has a draft model (chooser.candidates: auto weighs both)
LOOKED = "+lookup"


def split(name: str) -> tuple[str, dict]:
    """An entry's method -> (the method, the options it runs with besides): "naive+lookup" is naive with
    proposer "lookup"."""
    if name.endswith(LOOKED):
        return name[:-len(LOOKED)], {"proposer": "lookup"}
    return name, {}


def entry_name(candidate: dict) -> str:
    """The entry's method of a setting ({"method", "proposer"?, ...}: a chooser candidate, a choice's record);
    split's inverse."""
    return candidate["method"] + (LOOKED if candidate.get("proposer") == "lookup" else "")
