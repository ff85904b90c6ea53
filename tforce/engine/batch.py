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

from .generate import Result, _eos_ids, _modules, check_ids, configuration, generator
from .generation import run
from ..config import Sampling, Speculation
from ..errors import UsageError

BATCH_METHODS = ("ar", "triforce", "naive", "retrieval", "streaming")


def check_batchable(method: str, det: bool = False) -> None:
    """The one check of a batch's method: generate_batch's, and the command line's before any weights load
    (`run --batch`, and `bench --batch` with det=True: its methods may end in +det)."""
    if (method.removesuffix("+det") if det else method) not in BATCH_METHODS:
        note = " (each may end in +det)" if det else ""
        raise UsageError(f"--batch runs --method {'|'.join(BATCH_METHODS)}{note}, not {method!r}")


def generate_batch(target, prompts, *, draft=None, method: str = "ar", max_new_tokens: int | list[int] = 256,
                   temperature: float = Sampling.temperature, top_p: float = Sampling.top_p,
                   top_k: int = Sampling.top_k, seed: int | None = None, ignore_eos: bool = False,
                   budget: int = Speculation.budget, chunk_size: int = Speculation.chunk_size,
                   gamma1: int = Speculation.gamma1, gamma2: int = Speculation.gamma2,
                   draft_budget: int = Speculation.draft_budget, sinks: int = Speculation.sinks,
                   rebuild_every: int = Speculation.rebuild_every, rebuild_below: float = Speculation.rebuild_below,
                   policy: str = Speculation.policy, prefill_chunk: int = 512, offload: str = "auto",
                   gpu_memory: int | None = None, device_free: int | None = None, deterministic: bool = False,
                   cuda_graphs: bool = True, load_kv=None, on_row=None, until=None, on_prefill=None, on_round=None,
                   group=None) -> list[Result]:
    """One Result per prompt (a list of token-id lists, any lengths), in order; max_new_tokens: one budget
    for every row or a list with one per prompt; every row is exactly what
    `generate` gives for that prompt alone (greedy token for token; sampled, the same distribution).
    Each Result's stats (`generate`'s names): the batch's prefill_s and decode_s, batch_size,
    batch_tokens_per_s (all rows' tokens after each row's first, the prefill's, over decode_s: rates.py) and
    ms_per_token (its inverse, in ms),
    prefill_rebuild_s and rebuild_s (retrieval rebuilds of all rows: the prefill's, those during
    decoding); the row's verifications, tokens_per_verification, acceptance {"draft", "retrieval"} and
    retrieval rebuilds during decoding (rebuilds); the full cache's placement (kv_*).
    Options as `generate`'s, policy included (h2o: a recording pass over each row's prompt). The batch is
    planned before anything is allocated (placement.py with B rows) and refused if it does not fit;
    offload, gpu_memory and device_free as in `generate` (offloaded layers stream once per step for all
    rows). deterministic: the full cache verifies row by row (rowwise.py), each row's logits bit for bit
    those of one-token decoding of that prompt alone (greedy: each row is `ar`'s alone in any dtype, not
    only where no near-tie falls within a batched forward's rounding). on_row(r, tokens) is told each
    row's final tokens as soon as the row is finished (a row with no budget right after the prefill), so
    a caller keeps what is done if the rest fails or is interrupted.
    until(tokens) -> int | None: `generate`'s, asked of each row after each round with the row's tokens so
    far (stops.StopStrings.cut: each row ends at its first stop string, where it would alone); a row it
    ends leaves the batch as a row at EOS does. Progress, for a live view: on_prefill(done, total) as the
    prefill goes (`generate`'s: tokens of all rows, or token-layers where it runs layer-major); on_round(
    tokens, counts) after each round, with each row's new tokens ({prompt index: tokens}, as cut) and each
    level's (accepted, drafted) tokens so far over the batch's rows (statistics.level_counts).
    load_kv: a KV snapshot folder (`generate`'s): read once, its prefix goes into every row whose prompt
    starts with it (as far as it matches; questions about one loaded document), and only the rest of each
    prompt is prefilled; each Result's stats give kv_reused (that row's), kv_snapshot_tokens and load_kv_s."""
    from ..snapshot import identity as snapshot_identity

    check_batchable(method)
    identity = snapshot_identity.identity(target, draft, group) if load_kv is not None else None
    target, draft = _modules(target, draft)
    spec, sampling = configuration(target, draft, method=method, temperature=temperature, top_p=top_p, top_k=top_k,
                                   seed=seed, budget=budget, chunk_size=chunk_size, gamma1=gamma1, gamma2=gamma2,
                                   draft_budget=draft_budget, sinks=sinks, rebuild_every=rebuild_every,
                                   rebuild_below=rebuild_below, policy=policy)
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
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise UsageError(f"max_new_tokens: {len(budgets)} budgets for {len(prompts)} prompts")
    if min(budgets) < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {min(budgets)}")
    max_new = [min(m, context - len(p)) for p, m in zip(prompts, budgets)]
    eos = set() if ignore_eos else _eos_ids(target.config)
    outs, stats = run(target, draft, prompts, max_new, spec, sampling, generator(target, seed), eos,
                      prefill_chunk=prefill_chunk, offload=offload, gpu_memory=gpu_memory, device_free=device_free,
                      deterministic=deterministic, cuda_graphs=cuda_graphs, group=group, identity=identity,
                      load_kv=load_kv, on_prefill=on_prefill, on_round=on_round, on_row=on_row, until=until)
    return [Result(out, s) for out, s in zip(outs, stats)]
