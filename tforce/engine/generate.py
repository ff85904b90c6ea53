"""generate: checks the arguments of one prompt and runs it as a batch of one row (generation.py: the one
path of a Session, its prefill, decode loop and statistics, for one prompt and for a batch); and the
checks and helpers generate_batch and conversations share.

One generation = prefill every node on the prompt, then rounds of the top level until the token
budget or EOS; each round: (maybe) rebuild the retrieval cache, draft, verify, commit, stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Sampling, Speculation
from ..errors import UsageError
from .statistics import one_row
from .session import Session
from ..model.vocab import check_sizes, check_tokenizers


@dataclass
class Result:
    tokens: list[int]
    stats: dict


def _module(m):
    return getattr(m, "model", m) if not isinstance(m, torch.nn.Module) else m


def _modules(target, draft):
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


def _eos_ids(config) -> set[int]:
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


def configuration(target, draft, *, method: str, temperature: float, top_p: float, top_k: int, seed: int | None,
                  budget: int, chunk_size: int, gamma1: int, gamma2: int, draft_budget: int, sinks: int,
                  rebuild_every: int, rebuild_below: float, policy: str) -> tuple[Speculation, Sampling]:
    """The options as (Speculation, Sampling), each checked, and the draft checked against the target."""
    if method == "auto":
        raise UsageError("a session runs one method: 'auto' is chosen above the engine (tforce.generate, "
                         "auto/planner.py) before one opens")
    spec = Speculation(method=method, gamma1=gamma1, gamma2=gamma2, budget=budget, chunk_size=chunk_size,
                       draft_budget=draft_budget, sinks=sinks, rebuild_every=rebuild_every,
                       rebuild_below=rebuild_below, policy=policy)
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    spec.validate()
    sampling.validate()
    _check_pair(target, draft, spec)
    return spec, sampling


def open_session(target, draft, prompt_len: int, max_new: int, *, method: str = "triforce",
                 temperature: float = Sampling.temperature, top_p: float = Sampling.top_p,
                 top_k: int = Sampling.top_k, seed: int | None = None, budget: int = Speculation.budget,
                 chunk_size: int = Speculation.chunk_size, gamma1: int = Speculation.gamma1,
                 gamma2: int = Speculation.gamma2, draft_budget: int = Speculation.draft_budget,
                 sinks: int = Speculation.sinks, rebuild_every: int = Speculation.rebuild_every,
                 rebuild_below: float = Speculation.rebuild_below, policy: str = Speculation.policy,
                 prefill_chunk: int = 512, offload: str = "auto", gpu_memory: int | None = None,
                 cuda_graphs: bool = True, device_free: int | None = None, deterministic: bool = False,
                 group=None) -> Session:
    """The checked configuration's Session for prompt_len + max_new tokens (options: generate's)."""
    spec, sampling = configuration(target, draft, method=method, temperature=temperature, top_p=top_p, top_k=top_k,
                                   seed=seed, budget=budget, chunk_size=chunk_size, gamma1=gamma1, gamma2=gamma2,
                                   draft_budget=draft_budget, sinks=sinks, rebuild_every=rebuild_every,
                                   rebuild_below=rebuild_below, policy=policy)
    return Session(target, draft, prompt_len, max_new, spec, sampling, prefill_chunk, offload, gpu_memory,
                   cuda_graphs, device_free, deterministic, group)


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


def generate(target, prompt_ids, *, draft=None, method: str = "triforce", max_new_tokens: int = 256,
             temperature: float = Sampling.temperature, top_p: float = Sampling.top_p, top_k: int = Sampling.top_k,
             seed: int | None = None, ignore_eos: bool = False, budget: int = Speculation.budget,
             chunk_size: int = Speculation.chunk_size, gamma1: int = Speculation.gamma1,
             gamma2: int = Speculation.gamma2, draft_budget: int = Speculation.draft_budget,
             sinks: int = Speculation.sinks, rebuild_every: int = Speculation.rebuild_every,
             rebuild_below: float = Speculation.rebuild_below, policy: str = Speculation.policy,
             prefill_chunk: int = 512, offload: str = "auto", gpu_memory: int | None = None,
             cuda_graphs: bool = True, device_free: int | None = None, deterministic: bool = False, load_kv=None,
             save_kv=None, group=None, on_token=None, on_prefill=None, on_round=None, on_plan=None,
             until=None) -> Result:
    """Generate up to max_new_tokens after prompt_ids; exactly the target's greedy output (temperature 0)
    or an exact sample of its distribution. on_token(list[int]) gets tokens as they are accepted;
    on_prefill(done, total) reports prefill progress; on_round(tokens, acceptance) follows each
    verification with the acceptance so far per level ({"draft", "retrieval"}); on_plan(placement) gets
    the full KV cache's placement (the kv_* entries of the statistics) once planned, before prefill.
    until(tokens) -> int | None: after each round, given every token generated so far, how many to keep
    and end there (stops.StopStrings.cut), or None to go on; the tokens kept stay an exact prefix.
    offload: where the full KV cache lives ("auto": on the GPU while it fits, the rest in pinned host
    memory; "on": all in host memory; "off": all on the device); gpu_memory caps the bytes tforce may use on
    the GPU. device_free: the device's free bytes as the caller measured them (tensor-parallel ranks pass
    their minimum so that all plan alike; None: measured here); given on a CPU run, the KV cache is placed
    as if a device had that much room, which runs the offloaded cache's code path on the CPU (for tests).
    policy: which tokens the middle (retrieval) cache holds: retrieval | topk | streaming | h2o
    (cache/policies.py). deterministic: the
    full-cache level computes every drafted position's logits exactly as one-token decoding does
    (rowwise.py), so greedy output equals `ar`'s in any dtype; it costs weight reads per verification.
    KV snapshots (snapshot/format.py): load_kv, a snapshot folder: its caches are loaded and only the part of the
    prompt after its prefix is prefilled (a prompt that leaves the prefix keeps the common part;
    stats["kv_reused"] says how many of the snapshot's stats["kv_snapshot_tokens"] were reused); save_kv, a
    folder: the caches after prefill (the whole prompt) are written there. A snapshot loads only
    into the same model, tokenizer and dtype. group: the tensor-parallel ranks (parallel.Group) when target
    is one rank's shard: their memory plans must agree before any cache is allocated, and each rank's
    snapshot part holds its own KV heads.
    One method per run: "auto" is resolved above the engine (tforce.generate, auto/planner.py)."""
    from ..snapshot import format as snapshot, identity as snapshot_identity
    from .generation import run

    identity = snapshot_identity.identity(target, draft, group) if load_kv is not None or save_kv is not None else None
    target, draft = _modules(target, draft)
    prompt = [int(t) for t in prompt_ids]
    max_new = check_prompt(target, len(prompt), max_new_tokens)
    check_ids(target, prompt)
    spec, sampling = configuration(target, draft, method=method, temperature=temperature, top_p=top_p, top_k=top_k,
                                   seed=seed, budget=budget, chunk_size=chunk_size, gamma1=gamma1, gamma2=gamma2,
                                   draft_budget=draft_budget, sinks=sinks, rebuild_every=rebuild_every,
                                   rebuild_below=rebuild_below, policy=policy)
    if save_kv is not None:
        snapshot.check_target(save_kv)  # before the work, not after

    def told(r, tokens, acceptance):
        if on_token:
            on_token(tokens)
        if on_round:
            on_round(tokens, acceptance)

    eos = set() if ignore_eos else _eos_ids(target.config)
    # one prompt is a batch of one row: the batch's path (generation.py), its statistics those of the row
    [out], [stats] = run(target, draft, [prompt], [max_new], spec, sampling, generator(target, seed), eos,
                         prefill_chunk=prefill_chunk, offload=offload, gpu_memory=gpu_memory, cuda_graphs=cuda_graphs,
                         device_free=device_free, deterministic=deterministic, group=group, identity=identity,
                         load_kv=load_kv, save_kv=save_kv, on_plan=on_plan, on_prefill=on_prefill,
                         on_tokens=told if on_token or on_round else None, until=until)
    return Result(out, one_row(stats))
