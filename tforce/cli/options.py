"""The options the commands share (model, method, sampling, budgets, placement, snapshots): defined once
here, used as the defaults of the commands' parameters; the engine's defaults are config.py's."""
from __future__ import annotations

import functools
import inspect
import typing
from typing import List, Optional

import typer

from ..config import Sampling, Speculation
from .common import GPU_MEMORY_HELP, OFFLOAD_HELP, THREADS_HELP, flag

MODEL = typer.Option(None, "--model", "-m", help="Target: a folder, hub id or short name (default: the demo pair).")
DRAFT = typer.Option(None, "--draft", help="Small draft model (default: the registry's, or the sibling X-draft "
                                            "of a folder X-target; without --model, the demo's), or `lookup`: no "
                                            "model, the tokens that followed the last n tokens' latest earlier "
                                            "occurrence in the prompt and answer (prompt lookup; --method auto "
                                            "also weighs it where a draft model is given).")
LOOKUP_MAX = typer.Option(Speculation.lookup_max, "--lookup-max", help="The lookup draft: the longest n-gram matched.")
LOOKUP_MIN = typer.Option(Speculation.lookup_min, "--lookup-min", help="The lookup draft: the shortest n-gram matched.")
LOOKUP_THRESHOLD = typer.Option(Speculation.lookup_threshold, "--lookup-threshold",
                                help="The lookup draft: a match drafts as many tokens as have, all of them, at "
                                     "least this chance to come, from how matches of its length fared lately "
                                     "(0: every match drafts gamma).")
METHOD = typer.Option("auto", "--method", help="auto (the fastest on this machine, from measured stage costs: "
                                                "docs/auto.md) | triforce | ar | retrieval | streaming | naive")
MAX_NEW_TOKENS = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens to generate.")
TEMPERATURE = typer.Option(Sampling.temperature, "--temperature", "-t", help="0 = greedy.")
TOP_P = typer.Option(Sampling.top_p, "--top-p", help="Nucleus sampling, in (0, 1].")
TOP_K = typer.Option(Sampling.top_k, "--top-k", help="0 = off.")
SEED = typer.Option(None, "--seed", help="Random seed.")
IGNORE_EOS = flag("--ignore-eos", "Keep going past end-of-sequence.")
BUDGET = typer.Option(Speculation.budget, "--budget", help="Retrieval (or streaming) cache of the middle level.")
CHUNK_SIZE = typer.Option(Speculation.chunk_size, "--chunk-size", help="Retrieval chunk size.")
GAMMA1 = typer.Option(None, "--gamma1", help="Draft tokens per middle-level verification (default 2; with "
                                               "--method auto: planned unless given).")
GAMMA2 = typer.Option(None, "--gamma2", help="Tokens per full-cache verification (default 6; with --method auto: "
                                               "planned unless given).")
DRAFT_BUDGET = typer.Option(Speculation.draft_budget, "--draft-budget", help="StreamingLLM cache of the small draft.")
SINKS = typer.Option(Speculation.sinks, "--sinks", help="Attention-sink tokens of streaming caches.")
PREFILL_CHUNK = typer.Option(512, "--prefill-chunk", help="Prompt tokens per prefill forward (larger: fewer, "
                                                          "bigger matrix products and more activation memory, "
                                                          "which the plan counts).")
REBUILD_EVERY = typer.Option(Speculation.rebuild_every, "--rebuild-every",
                             help="Rebuild the retrieval cache every N tokens.")
REBUILD_BELOW = typer.Option(Speculation.rebuild_below, "--rebuild-below",
                             help="... or when acceptance falls below this.")
POLICY = typer.Option(Speculation.policy, "--policy",
                      help="Middle cache's selection: retrieval, shared, topk, streaming, h2o.")
DETERMINISTIC = flag("--deterministic", "Verify row by row, each logit bit for bit what one-token decoding "
                                        "computes: greedy output equals --method ar's in any dtype (costs weight "
                                        "reads per verification).")
DEVICE = typer.Option("auto", "--device", help="auto | cpu | cuda")
THREADS = typer.Option(0, "--threads", help=THREADS_HELP)
DTYPE = typer.Option("auto", "--dtype", help="auto | float32 | float16 | bfloat16")
WEIGHTS = typer.Option("auto", "--weights", help="auto: as the checkpoint has them (in --dtype; a GGUF's projections "
                                                 "kept quantized) | float: in --dtype | int8 (per channel) | int4 "
                                                 "(groups of 32): the target's projections quantized at load (CPU "
                                                 "or CUDA, one process).")
OFFLOAD = typer.Option("auto", "--offload", help=OFFLOAD_HELP)
GPU_MEMORY = typer.Option(None, "--gpu-memory", help=GPU_MEMORY_HELP)
SAVE_KV = typer.Option(None, "--save-kv", metavar="DIR",
                       help="Write the prefilled KV cache there (a snapshot folder; an existing snapshot is replaced).")
LOAD_KV = typer.Option(None, "--load-kv", metavar="DIR",
                       help="Start from a snapshot: only the prompt after its prefix is prefilled.")
TEMPLATE = typer.Option("auto", "--template", help="auto: lay the prompt out in the model's chat template when its "
                                                   "tokenizer has one (instruction-tuned models) | none: the text "
                                                   "as it is.")
STOP = typer.Option(None, "--stop", help="End the answer where its text first holds this string (repeatable); "
                                          "the string is not printed.")
SYSTEM = typer.Option(None, "--system", help="A system message (needs a chat template).")
TP = typer.Option(1, "--tp", help="Tensor-parallel ranks (processes); with --device cpu they use gloo.")
GPUS = typer.Option(None, "--gpus", help="Split the target over N GPUs (--tp N --device cuda).")


# The options run, chat and serve share, in the order their --help lists them, with their types.
SHARED = {
    "model": (Optional[str], MODEL), "draft": (Optional[str], DRAFT), "method": (str, METHOD),
    "max_new_tokens": (int, MAX_NEW_TOKENS), "temperature": (float, TEMPERATURE), "top_p": (float, TOP_P),
    "top_k": (int, TOP_K), "seed": (Optional[int], SEED), "ignore_eos": (bool, IGNORE_EOS), "budget": (int, BUDGET),
    "chunk_size": (int, CHUNK_SIZE), "gamma1": (Optional[int], GAMMA1), "gamma2": (Optional[int], GAMMA2),
    "draft_budget": (int, DRAFT_BUDGET), "prefill_chunk": (int, PREFILL_CHUNK), "sinks": (int, SINKS),
    "rebuild_every": (int, REBUILD_EVERY), "rebuild_below": (float, REBUILD_BELOW), "policy": (str, POLICY),
    "deterministic": (bool, DETERMINISTIC), "lookup_max": (int, LOOKUP_MAX), "lookup_min": (int, LOOKUP_MIN),
    "lookup_threshold": (float, LOOKUP_THRESHOLD),
    "device": (str, DEVICE), "threads": (int, THREADS),
    "dtype": (str, DTYPE), "weights": (str, WEIGHTS), "offload": (str, OFFLOAD), "gpu_memory": (Optional[str], GPU_MEMORY),
    "save_kv": (Optional[str], SAVE_KV), "load_kv": (Optional[str], LOAD_KV), "template": (str, TEMPLATE),
    "system": (Optional[str], SYSTEM), "stop": (Optional[List[str]], STOP), "tp": (int, TP),
    "gpus": (Optional[int], GPUS),
}


def shared(snapshots: bool = True, **overrides):
    """A command takes SHARED's options after its own, as one dict `opts` (every name of SHARED; save_kv
    and load_kv None without `snapshots`); overrides: name -> a typer.Option of the command's own (its
    help differs). Typer reads the command's signature, so the wrapper shows it the options one by one."""
    names = [n for n in SHARED if snapshots or n not in ("save_kv", "load_kv")]

    def wrap(command):
        own = inspect.signature(command)
        hints = typing.get_type_hints(command)
        params = [p.replace(annotation=hints.get(n, p.annotation)) for n, p in own.parameters.items() if n != "opts"]
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=overrides.get(n, SHARED[n][1]),
                                     annotation=SHARED[n][0]) for n in names]

        @functools.wraps(command)
        def wrapper(**given):
            opts = {n: given.pop(n) for n in names}
            return command(**given, opts={"save_kv": None, "load_kv": None, **opts})

        del wrapper.__wrapped__  # typer must see the signature below, not the command's own
        wrapper.__signature__ = own.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
        return wrapper

    return wrap
