"""generate: checks the configuration of one prompt and runs it as a batch of one row (run_rows: the one
path of a Session, a snapshot loaded, then the driver's prefill, decode loop and statistics, for one
prompt and for a batch); and the checks and helpers generate_batch and conversations share.

One generation = prefill every node on the prompt, then rounds of the top level until the token
budget or EOS; each round: (maybe) rebuild the retrieval cache, draft, verify, commit, stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import AUTO, RunConfig, Speculation
from ..errors import UsageError
from .driver import drive
from .events import Events
from .statistics import one_row, placement_stats
from .session import Session, sync_device
from ..model.vocab import check_sizes, check_tokenizers


@dataclass
class Result:
    tokens: list[int]
    stats: dict


def _module(m):
    return getattr(m, "model", m) if not isinstance(m, torch.nn.Module) else m


def networks(target, draft):
    """(target, draft) as networks; given as LoadedModels with their tokenizers, a draft with another
    tokenizer than the target's is refused here, where the tokenizers are still at hand (vocab.py). Bare
    networks, or a model loaded without its tokenizer (the CLI checks the folders before loading), carry
    nothing to compare: the caller vouches for the pair."""
    if draft is None:
        return _module(target), None
    target_tok, draft_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if target_tok is not None and draft_tok is not None:
        check_tokenizers(target_tok, draft_tok, str(getattr(draft, "path", "model")),
                         target.config.vocab_size, draft.config.vocab_size)
    return _module(target), _module(draft)


def eos_ids(config) -> set[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def _check_pair(target, draft, spec: Speculation) -> None:
    if not spec.uses_draft:
        return
    if draft is None:
        raise UsageError(f"method {spec.method!r} needs a draft model (--draft)")
    check_sizes(target.config.vocab_size, draft.config.vocab_size)


def check_config(target, draft, config: RunConfig) -> RunConfig:
    """The configuration checked, and the draft against the target; returned as it is."""
    if config.method == AUTO:
        raise UsageError("a session runs one method: 'auto' is chosen above the engine (tforce.generate, "
                         "auto/chooser.py) before one opens")
    config.validate()
    _check_pair(target, draft, config.speculation)
    return config


def configured(config: RunConfig | None, options: dict) -> RunConfig:
    """The API's configuration: `config` (default: RunConfig()'s defaults) with the flat options given
    beside it changed (RunConfig.with_options), as transformers' generate takes a GenerationConfig and
    keyword arguments that change it."""
    return (config if config is not None else RunConfig()).with_options(**options)


def open_session(target, draft, prompt_len: int, max_new: int, config: RunConfig, group=None) -> Session:
    """The checked configuration's Session for prompt_len + max_new tokens."""
    return Session(target, draft, prompt_len, max_new, check_config(target, draft, config), group)


def check_prompt(target, n: int, max_new_tokens: int) -> int:
    """Refuses an empty prompt or one that fills the context; returns how many new tokens fit after it."""
    context = target.config.max_position_embeddings
    if n == 0:
        raise UsageError("the prompt is empty")
    if n >= context:
        raise UsageError(f"the prompt is {n} tokens; the model's context is {context}")
    if max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    return min(max_new_tokens, context - n)


def check_ids(target, ids, what: str = "the prompt") -> None:
    """Refuses ids outside the target's vocabulary: they would index past its embedding table, an
    IndexError from inside a forward (on CUDA a device-side assert), not the bad argument they are."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    vocab = target.config.vocab_size
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise UsageError(f"{what} holds token id {int(bad[0])}, outside the model's vocabulary (0 to {vocab - 1})")


def generator(target, seed: int | None) -> torch.Generator:
    gen = torch.Generator(device=next(target.parameters()).device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    return gen


def generate(target, prompt_ids, config: RunConfig, draft=None, events: Events | None = None,
             group=None) -> Result:
    """Generate up to config.max_new_tokens after prompt_ids with one method (config.method; "auto" is
    resolved above the engine: tforce.generate, auto/chooser.py); exactly the target's greedy output
    (temperature 0) or an exact sample of its distribution. target and draft: networks, or LoadedModels
    (their tokenizers are then checked against each other). events (events.py): what the run tells as it
    goes, the prompt being row 0. group: the tensor-parallel ranks (parallel.Group) when target is one
    rank's shard: their memory plans must agree before any cache is allocated, and each rank's snapshot
    part holds its own KV heads.
    The options (config.py, RunConfig): offload: where the full KV cache lives ("auto": on the GPU while
    it fits, the rest in pinned host memory; "on": all in host memory; "off": all on the device);
    gpu_memory caps the bytes tforce may use on the GPU; device_free: the device's free bytes as the
    caller measured them (given on a CPU run, the KV cache is placed as if a device had that much room,
    which runs the offloaded cache's code path on the CPU, for tests). policy: which tokens the middle
    (retrieval) cache holds: retrieval | topk | streaming | h2o (cache/policies.py). deterministic: the
    full-cache level computes every drafted position's logits exactly as one-token decoding does
    (rowwise.py), so greedy output equals `ar`'s in any dtype; it costs weight reads per verification.
    KV snapshots (snapshot/format.py): load_kv, a snapshot folder: its caches are loaded and only the part
    of the prompt after its prefix is prefilled (a prompt that leaves the prefix keeps the common part;
    stats["kv_reused"] says how many of the snapshot's stats["kv_snapshot_tokens"] were reused); save_kv, a
    folder: the caches after prefill (the whole prompt) are written there. A snapshot loads only into the
    same model, tokenizer and dtype."""
    from ..snapshot import format as snapshot, identity as snapshot_identity

    kv = config.load_kv is not None or config.save_kv is not None
    identity = snapshot_identity.identity(target, draft, group) if kv else None
    target, draft = networks(target, draft)
    prompt = [int(t) for t in prompt_ids]
    if not isinstance(config.max_new_tokens, int):
        raise UsageError("one prompt takes one max_new_tokens, not a list (generate_batch takes one per prompt)")
    max_new = check_prompt(target, len(prompt), config.max_new_tokens)
    check_ids(target, prompt)
    check_config(target, draft, config)
    if config.save_kv is not None:
        snapshot.check_target(config.save_kv)  # before the work, not after
    eos = set() if config.ignore_eos else eos_ids(target.config)
    # one prompt is a batch of one row: the batch's path (run_rows), its statistics those of the row
    [out], [stats] = run_rows(target, draft, [prompt], [max_new], config, generator(target, config.sampling.seed),
                              eos, events or Events(), group, identity)
    return Result(out, one_row(stats))


def run_rows(target, draft, prompts: list[list[int]], max_new: list[int], config: RunConfig, gen: torch.Generator,
             eos: set[int], events: Events = Events(), group=None, identity=None
             ) -> tuple[list[list[int]], list[dict]]:
    """The one path of a generation over B rows, for `generate` (one prompt: B = 1) and `generate_batch` (a
    row per prompt): (each prompt's new tokens, each prompt's statistics) of one Session over the prompts
    (token-id lists, checked; max_new: each one's budget, fitted to the context), telling `events` as it goes
    (events.py).
    config.load_kv: a snapshot read once into every row that starts with its prefix; config.save_kv (one
    prompt): the caches after the prefill; identity: the models' (snapshot/identity.py)."""
    B, longest = len(prompts), max(map(len, prompts))
    load_kv, save_kv = config.load_kv, config.save_kv
    if save_kv is not None and B > 1:
        raise UsageError("a KV snapshot is saved from one prompt, not a batch")
    from ..snapshot import store as snapshot_io

    total = max(len(p) + m for p, m in zip(prompts, max_new))
    # planned for B rows before anything is allocated: raises when the rows do not fit
    session = Session(target, draft, longest, total - longest, config, group, rows=B)
    if events.on_plan:
        events.on_plan(placement_stats(session.plan))
    device = next(target.parameters()).device
    t0 = time.perf_counter()
    kv: list[dict] = [{} for _ in prompts]
    if load_kv is not None:
        rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
        reused, length = snapshot_io.load_rows(load_kv, session, rows, [len(p) - 1 for p in prompts], identity, group)
        sync_device(device)
        kv = [{"kv_reused": c, "kv_snapshot_tokens": length, "load_kv_s": time.perf_counter() - t0} for c in reused]
    saved = {}

    def save() -> None:
        t = time.perf_counter()
        snapshot_io.save(save_kv, session, identity, group)
        saved["save_kv_s"] = time.perf_counter() - t

    outs, stats = drive(session, prompts, max_new, gen, eos, events, t0, save if save_kv is not None else None)
    return outs, [{**s, "batch_size": B, **kv[r], **saved} for r, s in enumerate(stats)]
