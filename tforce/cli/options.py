"""The options `tforce run` and `tforce chat` share (model, method, sampling, budgets, placement, snapshots):
defined once here, used as the defaults of both commands' parameters."""
from __future__ import annotations

import typer

from .common import GPU_MEMORY_HELP, OFFLOAD_HELP, THREADS_HELP, flag

MODEL = typer.Option(None, "--model", "-m", help="Target: a folder, hub id or short name (default: the demo pair).")
DRAFT = typer.Option(None, "--draft", help="Small draft model (default: the registry's, or the sibling X-draft "
                                            "of a folder X-target; without --model, the demo's).")
METHOD = typer.Option("auto", "--method", help="auto (the fastest on this machine, from measured stage costs: "
                                                "docs/auto.md) | triforce | ar | retrieval | streaming | naive")
MAX_NEW_TOKENS = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens to generate.")
TEMPERATURE = typer.Option(0.6, "--temperature", "-t", help="0 = greedy.")
TOP_P = typer.Option(0.9, "--top-p", help="Nucleus sampling, in (0, 1].")
TOP_K = typer.Option(0, "--top-k", help="0 = off.")
SEED = typer.Option(None, "--seed", help="Random seed.")
IGNORE_EOS = flag("--ignore-eos", "Keep going past end-of-sequence.")
BUDGET = typer.Option(4096, "--budget", help="Retrieval (or streaming) cache of the middle level.")
CHUNK_SIZE = typer.Option(8, "--chunk-size", help="Retrieval chunk size.")
GAMMA1 = typer.Option(None, "--gamma1", help="Draft tokens per middle-level verification (default 2; with "
                                               "--method auto: planned unless given).")
GAMMA2 = typer.Option(None, "--gamma2", help="Tokens per full-cache verification (default 6; with --method auto: "
                                               "planned unless given).")
DRAFT_BUDGET = typer.Option(256, "--draft-budget", help="StreamingLLM cache of the small draft.")
SINKS = typer.Option(16, "--sinks", help="Attention-sink tokens of streaming caches.")
PREFILL_CHUNK = typer.Option(512, "--prefill-chunk", help="Prompt tokens per prefill forward (larger: fewer, "
                                                          "bigger matrix products and more activation memory, "
                                                          "which the plan counts).")
REBUILD_EVERY = typer.Option(128, "--rebuild-every", help="Rebuild the retrieval cache every N tokens.")
REBUILD_BELOW = typer.Option(0.3, "--rebuild-below", help="... or when acceptance falls below this.")
POLICY = typer.Option("retrieval", "--policy", help="Middle cache's selection: retrieval, shared, topk, streaming, h2o.")
DETERMINISTIC = flag("--deterministic", "Verify row by row, each logit bit for bit what one-token decoding "
                                        "computes: greedy output equals --method ar's in any dtype (costs weight "
                                        "reads per verification).")
DEVICE = typer.Option("auto", "--device", help="auto | cpu | cuda")
THREADS = typer.Option(0, "--threads", help=THREADS_HELP)
DTYPE = typer.Option("auto", "--dtype", help="auto | float32 | float16 | bfloat16")
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

# The parameters above that go to the engine as they are (generate's keyword arguments).
ENGINE = ("method", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "budget", "chunk_size",
          "gamma1", "gamma2", "draft_budget", "sinks", "rebuild_every", "rebuild_below", "policy", "deterministic",
          "prefill_chunk")
