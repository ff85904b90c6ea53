"""generate_batch: several prompts through one decode loop, each row exact on its own.

Every forward feeds all live rows at once (the weights are read once per step for the whole batch);
each row keeps its own length in the caches (cache/batched.py, the rule in cache/base.py), accepts its
own number of drafted tokens, and leaves the batch when it reaches EOS or its token budget (its cache
rows are compacted away, so it costs no further work). Methods so far: `ar` (plain decoding) and
`naive` (a small draft with a StreamingLLM cache drafts gamma2 tokens per row; the target with its full
cache verifies every row's drafts in one forward). The full cache may be offloaded in part
(cache/rows_offload.py); the prefill then runs token-major (each chunk streams the offloaded prefixes
again: PCIe traffic quadratic in the prompt; the single-prompt path's layer-major prefill is not batched).
"""
from __future__ import annotations

import time

import torch

from . import placement
from .cache.batched import RowsCache, RowsStreamingCache
from .cache.rows_offload import RowsOffloadedCache
from .config import Sampling, Speculation
from .engine import Result, _check_pair, _eos_ids, _module, _placement, _plan, _sync_device
from .errors import UsageError
from .rope import Rotary
from .sampling import sample, to_probs
from .speculative import verify_rows
from .sync import host, to_device

BATCH_METHODS = ("ar", "naive")


class RowsNode:
    """One network with one batched cache: feeds each live row its own tokens in one forward."""

    def __init__(self, model, cache, sampling: Sampling, prefill_chunk: int):
        self.model, self.cache, self.sampling, self.prefill_chunk = model, cache, sampling, prefill_chunk
        self.device = next(model.parameters()).device

    def feed(self, rows: list[list[int]], last: int | None) -> torch.Tensor | None:
        """Row b's tokens rows[b] after what its cache holds, padded at the end to the longest (the
        padding is never committed); probs (B, last, V) after each row's last `last` real tokens
        (every row must feed at least `last`), or None for last=None (prefill: no logits)."""
        counts = [len(r) for r in rows]
        T = max(counts)
        ids = torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long)  # (B, T)
        self.cache.begin(T)
        logits = self.model(to_device(ids, self.device), self.cache, last_n=None if last else 0)  # (B, T, V)
        self.cache.commit(torch.tensor(counts))
        if not last:
            return None
        pick = torch.tensor(counts)[:, None] - last + torch.arange(last)  # (B, last)
        pick = to_device(pick, logits.device)
        chosen = logits.gather(1, pick[..., None].expand(-1, -1, logits.shape[-1]))
        return to_probs(chosen.reshape(-1, logits.shape[-1]), self.sampling).view(len(rows), last, -1)

    def prefill(self, prompts: list[list[int]]) -> None:
        """Each row's prompt but its last token, in chunks of prefill_chunk tokens per row."""
        longest = max(len(p) for p in prompts)
        for start in range(0, longest - 1, self.prefill_chunk):
            self.feed([p[:-1][start:start + self.prefill_chunk] for p in prompts], None)


class _RowState:
    """The host-side state of the live rows: index into the caller's list, tokens so far, budget."""

    def __init__(self, prompts, max_new: list[int]):
        self.ids = list(range(len(prompts)))  # live row i is prompt self.ids[i]
        self.seq = [list(p) for p in prompts]
        self.out = [[] for _ in prompts]
        self.max_new = max_new
        self.verified = [0] * len(prompts)
        self.drafted = [0] * len(prompts)
        self.accepted = [0] * len(prompts)

    def add(self, i: int, tokens: list[int], eos: set[int]) -> bool:
        """Row i's new tokens, cut at its budget and at EOS; True when the row is done."""
        r = self.ids[i]
        tokens = tokens[: self.max_new[r] - len(self.out[r])]
        stop = next((j for j, t in enumerate(tokens) if t in eos), None)
        if stop is not None:
            tokens = tokens[: stop + 1]
        self.out[r] += tokens
        self.seq[r] += tokens
        return stop is not None or len(self.out[r]) >= self.max_new[r]


def generate_batch(target, prompts, *, draft=None, method: str = "ar", max_new_tokens: int | list[int] = 256,
                   temperature: float = 0.6, top_p: float = 0.9, top_k: int = 0, seed: int | None = None,
                   ignore_eos: bool = False, gamma2: int = 6, draft_budget: int = 256, sinks: int = 16,
                   prefill_chunk: int = 512, offload: str = "auto", gpu_memory: int | None = None,
                   device_free: int | None = None) -> list[Result]:
    """One Result per prompt (a list of token-id lists, any lengths), in order; max_new_tokens: one budget
    for every row or a list with one per prompt; every row is exactly what
    `generate` gives for that prompt alone (greedy token for token; sampled, the same distribution).
    Each Result's stats: the batch's prefill_s and decode_s, batch_size, batch_tokens_per_s (all rows'
    tokens over decode_s), the row's verifications and draft acceptance, the full cache's placement
    (kv_*). The batch is planned before anything is allocated (placement.py with B rows) and refused if
    it does not fit; offload, gpu_memory and device_free as in `generate` (offloaded layers stream once
    per step for all rows)."""
    spec = Speculation(method=method, gamma2=gamma2, draft_budget=draft_budget, sinks=sinks)
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    spec.validate()
    sampling.validate()
    if method not in BATCH_METHODS:
        raise UsageError(f"batches run --method {'|'.join(BATCH_METHODS)} so far, not {method!r}")
    target, draft = _module(target), (_module(draft) if draft is not None else None)
    _check_pair(target, draft, spec)
    prompts = [list(map(int, p)) for p in prompts]
    context = target.config.max_position_embeddings
    if not prompts:
        raise UsageError("the batch has no prompts")
    for i, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {i + 1} of the batch is empty")
        if len(p) >= context:
            raise UsageError(f"prompt {i + 1} of the batch is {len(p)} tokens; the model's context is {context}")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise UsageError(f"max_new_tokens: {len(budgets)} budgets for {len(prompts)} prompts")
    if min(budgets) < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {min(budgets)}")
    max_new = [min(m, context - len(p)) for p, m in zip(prompts, budgets)]
    if (target.config.rope_parameters or {}).get("rope_type") == "dynamic":
        # its frequencies depend on each row's final length (rope.py): one rotation per row, not done
        raise UsageError("batches do not support dynamic NTK RoPE yet")
    device = next(target.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())

    B, total = len(prompts), max(len(p) + m for p, m in zip(prompts, max_new))
    work = placement.Work.of(spec, total + spec.max_lookahead + 1, max(map(len, prompts)) - 1, prefill_chunk,
                             False, "sdpa" if device.type == "cuda" else "math", rows=B)
    plan = _plan(target, draft, work, offload, gpu_memory, device_free)  # raises when the batch does not fit
    full = _full_node(target, B, total, spec.max_lookahead, plan.resident, sampling, prefill_chunk)
    small = _draft_node(draft, B, total, spec, sampling, prefill_chunk) if method == "naive" else None
    rows = _RowState(prompts, max_new)
    t0 = time.perf_counter()
    for node in (full, small):
        if node is not None:
            node.prefill(prompts)
    _sync_device(device)
    t1 = time.perf_counter()
    eos = set() if ignore_eos else _eos_ids(target.config)
    live = [i for i in range(B) if max_new[i] > 0]
    _keep(rows, live, full, small)
    while rows.ids:
        if method == "ar":
            news = _ar_step(full, rows, gen)
        else:
            news = _naive_round(full, small, rows, spec.gamma2, gen)
        done = [rows.add(i, tokens, eos) for i, tokens in enumerate(news)]
        if any(done):
            _keep(rows, [i for i, d in enumerate(done) if not d], full, small)
    _sync_device(device)
    t2 = time.perf_counter()
    return [Result(rows.out[r], {**_stats(rows, r, t1 - t0, t2 - t1), **_placement(plan)}) for r in range(B)]


def _full_node(target, B: int, total: int, lookahead: int, resident: int, sampling: Sampling,
               prefill_chunk: int) -> RowsNode:
    cfg, p = target.config, next(target.parameters())
    dims = (cfg.num_hidden_layers, B, target.n_kv_heads, target.head_dim, total + lookahead + 1,
            Rotary(cfg, max_len=total, device=p.device))
    if resident == cfg.num_hidden_layers:
        cache = RowsCache(*dims, dtype=p.dtype, device=p.device)
    else:
        cache = RowsOffloadedCache(*dims, resident=resident, dtype=p.dtype, device=p.device)
    return RowsNode(target, cache, sampling, prefill_chunk)


def _draft_node(draft, B: int, total: int, spec: Speculation, sampling: Sampling, prefill_chunk: int) -> RowsNode:
    cfg, p = draft.config, next(draft.parameters())
    chunk = min(prefill_chunk, spec.draft_budget)
    cache = RowsStreamingCache(cfg.num_hidden_layers, B, draft.n_kv_heads, draft.head_dim,
                               budget=spec.draft_budget, sinks=spec.sinks,
                               rotary=Rotary(cfg, max_len=total, device=p.device),
                               max_rollback=spec.max_lookahead, max_new=chunk + spec.max_lookahead,
                               dtype=p.dtype, device=p.device)
    return RowsNode(draft, cache, sampling, chunk)


def _keep(rows: _RowState, live: list[int], *nodes) -> None:
    """Only the live rows stay, in the caches and in the host state."""
    rows.ids = [rows.ids[i] for i in live]
    for node in nodes:
        if node is not None:
            node.cache.keep(live)


def _ar_step(full: RowsNode, rows: _RowState, gen) -> list[list[int]]:
    """Plain decoding: every row feeds its last token and samples the next (one host sync)."""
    p = full.feed([[rows.seq[r][-1]] for r in rows.ids], last=1)  # (B, 1, V)
    tokens = host(sample(p[:, 0], gen))
    for i in range(len(tokens)):
        rows.verified[rows.ids[i]] += 1
    return [[t] for t in tokens]


def _naive_round(full: RowsNode, small: RowsNode, rows: _RowState, gamma: int, gen) -> list[list[int]]:
    """The draft proposes gamma tokens per row; the full cache verifies all rows in one forward; row b
    accepts its own count. Before the round each row's full cache holds its sequence but the last token,
    its draft cache some prefix of it (what earlier rounds fed and their verdicts kept)."""
    seqs = [rows.seq[r] for r in rows.ids]
    held = small.cache.lengths[:len(seqs)]
    small.cache.truncate(torch.minimum(held, torch.tensor([len(s) - 1 for s in seqs])))
    feed = [s[int(h):] for s, h in zip(seqs, small.cache.lengths)]  # 1 token, or 2 after an all-accepted round
    drafts, qs = [], []
    for step in range(gamma):
        q = small.feed(feed, last=1)[:, 0]  # (B, V)
        x = host(sample(q, gen))  # a host sync per drafted token, as the single-row Drafter
        drafts.append(x)
        qs.append(q)
        feed = [[t] for t in x]
    tokens = torch.tensor(drafts).T  # (B, gamma)
    p = full.feed([[s[-1]] + list(d) for s, d in zip(seqs, tokens.tolist())], last=gamma + 1)  # (B, gamma + 1, V)
    q = torch.stack(qs, dim=1).to(p.device)  # (B, gamma, V)
    n_acc, nxt = verify_rows(to_device(tokens, p.device), q, p, gen)
    full.cache.truncate(torch.tensor([len(s) + a for s, a in zip(seqs, n_acc)]))  # accepted drafts stay
    out = []
    for i, r in enumerate(rows.ids):
        rows.verified[r] += 1
        rows.drafted[r] += gamma
        rows.accepted[r] += n_acc[i]
        out.append(tokens[i, :n_acc[i]].tolist() + [nxt[i]])
    return out


def _stats(rows: _RowState, r: int, prefill_s: float, decode_s: float) -> dict:
    n_all = sum(len(o) for o in rows.out)
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "batch_size": len(rows.out),
        "batch_tokens_per_s": n_all / decode_s if n_all and decode_s > 0 else None,
        "verifications": rows.verified[r],
        "acceptance": {"draft": rows.accepted[r] / rows.drafted[r] if rows.drafted[r] else None,
                       "retrieval": None},
    }
