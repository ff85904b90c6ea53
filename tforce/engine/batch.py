"""generate_batch: several prompts through one decode loop, each row exact on its own.

Each forward feeds the live rows at once (the weights are read once per step for the whole batch; a row
that has its drafts for a round sits the rest of the round out: levels.py); each row keeps its own length
in the caches (one class per cache kind, one row per prompt: docs/architecture.md), accepts its own number
of drafted tokens, and leaves the batch when it reaches EOS, a stop string (`until`) or its token budget
(its cache rows are compacted away, so it costs no further work).
The same Session (session.py) and decode loop (decode.py) as `generate`, with a row per prompt: every
method (`ar`, `naive`, `retrieval`, `streaming`, `triforce`), per-row retrieval rebuilds
(Session._maybe_rebuild), selecting by the chunk rule (policy retrieval or shared) or a policies.py rule
(topk, streaming, h2o: each row's heavy hitters from its own prompt). The full cache may be offloaded in
part (cache/offload.py); the prefill then runs layer-major for all rows (prefill.py: each offloaded layer's
prompt K/V cross to host memory once, nothing streams back; PCIe traffic linear in the prompts).
"""
from __future__ import annotations

from .events import Events
from .generate import Result, check_config, check_ids, configured, eos_ids, generator, networks, run_rows
from ..config import RunConfig
from ..errors import UsageError

BATCH_METHODS = ("ar", "triforce", "naive", "retrieval", "streaming")


def check_batchable(method: str, det: bool = False) -> None:
    """The one check of a batch's method: generate_batch's, and the command line's before any weights load
    (`run --batch`, and `bench --batch` with det=True: its methods may end in +det)."""
    if (method.removesuffix("+det") if det else method) not in BATCH_METHODS:
        note = " (each may end in +det)" if det else ""
        raise UsageError(f"--batch runs --method {'|'.join(BATCH_METHODS)}{note}, not {method!r}")


def generate_batch(target, prompts, config: RunConfig | None = None, *, draft=None, events: Events | None = None,
                   group=None, **options) -> list[Result]:
    """One Result per prompt (a list of token-id lists, any lengths), in order, with `config` and the flat
    options beside it (generate's; the default method here is ar); max_new_tokens: one budget for every
    row, or a list with one per prompt; every row is exactly what
    `generate` gives for that prompt alone (greedy token for token; sampled, the same distribution).
    Each Result's stats (`generate`'s names): the batch's prefill_s and decode_s, batch_size,
    batch_tokens_per_s (all rows' tokens after each row's first, the prefill's, over decode_s: rates.py) and
    ms_per_token (its inverse, in ms),
    prefill_rebuild_s and rebuild_s (retrieval rebuilds of all rows: the prefill's, those during
    decoding); the row's verifications, tokens_per_verification, acceptance {"draft", "retrieval"} and
    retrieval rebuilds during decoding (rebuilds); the full cache's placement (kv_*).
    Policy h2o makes a recording pass over each row's prompt. The batch is
    planned before anything is allocated (placement.py with B rows) and refused if it does not fit;
    offload, gpu_memory and device_free as in `generate` (offloaded layers stream once per step for all
    rows). deterministic: the full cache verifies row by row (rowwise.py), each row's logits bit for bit
    those of one-token decoding of that prompt alone (greedy: each row is `ar`'s alone in any dtype, not
    only where no near-tie falls within a batched forward's rounding). events.on_row is told each
    row's final tokens as soon as the row is finished (a row with no budget right after the prefill), so
    a caller keeps what is done if the rest fails or is interrupted. events.until is asked of each row
    after each round with the row's tokens so far (stops.StopStrings.cut: each row ends at its first stop
    string, where it would alone); a row it ends leaves the batch as a row at EOS does.
    load_kv: a KV snapshot folder (`generate`'s): read once, its prefix goes into every row whose prompt
    starts with it (as far as it matches; questions about one loaded document), and only the rest of each
    prompt is prefilled; each Result's stats give kv_reused (that row's), kv_snapshot_tokens and load_kv_s."""
    from ..snapshot import identity as snapshot_identity

    config = configured(RunConfig.of(method="ar") if config is None else config, options)
    check_batchable(config.method)
    identity = snapshot_identity.identity(target, draft, group) if config.load_kv is not None else None
    target, draft = networks(target, draft)
    check_config(target, draft, config)
    prompts = [list(map(int, p)) for p in prompts]
    context = target.config.max_position_embeddings
    if not prompts:
        raise UsageError("the batch has no prompts")
    for i, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {i + 1} of the batch is empty")
        if len(p) >= context:
            raise UsageError(f"prompt {i + 1} of the batch is {len(p)} tokens; the model's context is {context}")
        check_ids(target, p, f"prompt {i + 1} of the batch")
    budgets = config.max_new_tokens
    budgets = [budgets] * len(prompts) if isinstance(budgets, int) else list(budgets)
    if len(budgets) != len(prompts):
        raise UsageError(f"max_new_tokens: {len(budgets)} budgets for {len(prompts)} prompts")
    max_new = [min(m, context - len(p)) for p, m in zip(prompts, budgets)]
    eos = set() if config.ignore_eos else eos_ids(target.config)
    outs, stats = run_rows(target, draft, prompts, max_new, config, generator(target, config.sampling.seed), eos,
                      events or Events(), group, identity)
    return [Result(out, s) for out, s in zip(outs, stats)]
