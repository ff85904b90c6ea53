"""The rows of one batch of generate_batch (batch.py): their host-side state (_RowState) and _Batch, the
nodes and levels composed for all rows as session.Session composes them for one prompt, with the prefill
(layer-major into an offloaded full cache) and the per-row retrieval rebuilds.
"""
from __future__ import annotations

import time

import torch

from .cache import FullCache, RetrievalCache, StreamingCache
from .cache.offload import OffloadedCache
from .cache.policies import make_select
from .config import Sampling, Speculation
from .levels import Drafter, Node, SpecLevel
from .prefill import prefill_layer_major
from .rope import Rotary
from .session import _sync_device
from .stops import end_of_round
from .vocab import shared_vocabulary

class _RowState:
    """The host-side state of the live rows: index into the caller's list, tokens so far, budget."""

    def __init__(self, prompts, max_new: list[int]):
        self.ids = list(range(len(prompts)))  # live row i is prompt self.ids[i]
        self.seq = [list(p) for p in prompts]
        self.out = [[] for _ in prompts]
        self.max_new = max_new
        self.verified = [0] * len(prompts)  # full-cache forwards that decided the row's tokens
        self.rebuilds = [0] * len(prompts)  # retrieval rebuilds during decoding

    def add(self, i: int, tokens: list[int], eos: set[int], until=None) -> bool:
        """Row i's new tokens, cut at its budget, after an EOS and where until says (a stop string), as
        engine.decode cuts one prompt's; True when the row is done."""
        r = self.ids[i]
        tokens = tokens[: self.max_new[r] - len(self.out[r])]
        end = end_of_round(self.out[r], tokens, eos, until)
        if end is not None:
            tokens = tokens[:end]
        self.out[r] += tokens
        self.seq[r] += tokens
        return end is not None or len(self.out[r]) >= self.max_new[r]


class _Batch:
    """The nodes and levels of one batch, composed as session.Session composes them for one prompt, and the
    per-row retrieval rebuilds (Session._maybe_rebuild's rules, per row)."""

    def __init__(self, target, draft, spec: Speculation, sampling: Sampling, rows: _RowState, total: int,
                 resident: int, prefill_chunk: int, recompute_stats: bool = False):
        self.spec, self.rows, self.target = spec, rows, target
        B, cfg, p = len(rows.seq), target.config, next(target.parameters())
        self.capacity = capacity = spec.capacity(total)
        rotary = Rotary(cfg, max_len=total, device=p.device)
        dims = (cfg.num_hidden_layers, target.n_kv_heads, target.head_dim)
        if resident == cfg.num_hidden_layers:
            full = FullCache(*dims, capacity, rotary, dtype=p.dtype, device=p.device, rows=B)
        else:
            full = OffloadedCache(*dims, capacity, rotary, resident=resident, dtype=p.dtype, device=p.device,
                                  rows=B)
        self.full = Node("full", target, full, sampling, capacity, prefill_chunk)
        self.middle = self.small = self.retrieval = None
        if spec.method in ("triforce", "retrieval"):
            self.retrieval = RetrievalCache(*dims, spec.budget, spec.chunk_size, rotary, dtype=p.dtype,
                                            device=p.device, shared=spec.policy == "shared",
                                            select=make_select(spec.policy, spec.sinks),
                                            recompute_stats=recompute_stats, rows=B)
            self.middle = Node("retrieval", target, self.retrieval, sampling, capacity, prefill_chunk)
        elif spec.method == "streaming":
            cache = StreamingCache(*dims, budget=spec.budget, sinks=spec.sinks, rotary=rotary,
                                   max_rollback=spec.max_lookahead, max_new=prefill_chunk + spec.max_lookahead,
                                   dtype=p.dtype, device=p.device, rows=B)
            self.middle = Node("streaming", target, cache, sampling, capacity, prefill_chunk)
        if spec.uses_draft:
            dcfg, dp = draft.config, next(draft.parameters())
            chunk = min(prefill_chunk, spec.draft_budget)
            cache = StreamingCache(dcfg.num_hidden_layers, draft.n_kv_heads, draft.head_dim,
                                   budget=spec.draft_budget, sinks=spec.sinks,
                                   rotary=Rotary(dcfg, max_len=total, device=dp.device),
                                   max_rollback=spec.max_lookahead, max_new=chunk + spec.max_lookahead,
                                   dtype=dp.dtype, device=dp.device, rows=B)
            self.small = Node("draft", draft, cache, sampling, capacity, chunk,
                              vocab=shared_vocabulary(draft, cfg.vocab_size))
        self.top, self.draft_level, self.middle_level = self._compose(B)

    def _compose(self, B: int):
        """(top level, level verifying the small draft, level verifying the middle level), as Session's."""
        s, ids = self.spec, self.rows.ids
        if s.method == "ar":
            return Drafter(self.full), None, None
        if s.method == "naive":
            top = SpecLevel(Drafter(self.small), self.full, s.gamma2, ids, B)
            return top, top, None
        if s.method == "retrieval":
            top = SpecLevel(Drafter(self.middle), self.full, s.gamma2, ids, B)
            return top, None, top
        mid = SpecLevel(Drafter(self.small), self.middle, s.gamma1, ids, B)
        top = SpecLevel(mid, self.full, s.gamma2, ids, B)
        return top, mid, top

    def nodes(self) -> list[Node]:
        return [n for n in (self.full, self.middle, self.small) if n is not None]

    def _buffer(self, seqs: list[list[int]] | None = None) -> tuple[torch.Tensor, list[int]]:
        """The live rows' sequences (or `seqs`) as the levels' (B, capacity) buffer, and their lengths."""
        seqs = [self.rows.seq[r] for r in self.rows.ids] if seqs is None else seqs
        buf = torch.zeros(len(seqs), self.capacity, dtype=torch.long)
        for b, s in enumerate(seqs):
            buf[b, :len(s)] = torch.tensor(s, dtype=torch.long)
        return buf, [len(s) for s in seqs]

    def prefill(self, prompts: list[list[int]]) -> None:
        """Every node takes each row's prompt but its last token; the retrieval cache is built from the
        full cache (every row rebuilt from its last prompt token but one). An offloaded full cache is
        filled layer-major (prefill.py: PCIe traffic linear in the prompts, the retrieval statistics taken
        on the device), as Session.prefill does for one prompt."""
        heads = [p[:-1] for p in prompts]
        buf, counts = self._buffer(heads)
        full = self.full.cache
        if isinstance(full, OffloadedCache) and max(map(len, heads)):
            chunk_rule = self.retrieval is not None and self.retrieval.select is None
            observe = (lambda i, k: self.retrieval.observe(full, i, k, counts)) if chunk_rule else None
            prefill_layer_major(self.target, heads, full, self.full.prefill_chunk, on_layer=observe)
            self.full.adopt(buf, counts)
        else:
            self.full.prefill(buf, counts)
        if self.retrieval is not None:
            self._rebuild(list(range(len(prompts))), buf)
        elif self.middle is not None:
            self.middle.prefill(buf, counts)
        if self.small is not None:
            self.small.prefill(buf, counts)

    rebuild_times: tuple[float, ...] = ()  # seconds of each _rebuild call (all its rows), the prefill's first

    def _rebuild(self, live: list[int], buf: torch.Tensor) -> None:
        """Rebuild the listed live rows from what the full cache holds of buf (re-feeding a row's last token
        when its query is not at hand); timed as Session._rebuild times one, for all the rows together."""
        device = self.full.device
        _sync_device(device)  # time the rebuild alone, not the work queued before it
        t0 = time.perf_counter()
        full = self.full.cache
        lengths = [self.full.held(i) for i in live]
        missing = tuple(i for i, L in zip(live, lengths) if L and full.query_at(i, L - 1) is None)
        if missing:
            self.full.prefill(buf, [self.full.held(i) for i in range(len(buf))], refeed=missing)
        queries = [full.query_at(i, L - 1) if L else [] for i, L in zip(live, lengths)]
        self.retrieval.rebuild(full, live, queries)
        self.middle.adopt(buf[live], lengths, live)
        for i in live:
            if self.middle_level is not None:
                self.middle_level.stats.recent[self.rows.ids[i]] = []
        _sync_device(device)
        self.rebuild_times += (time.perf_counter() - t0,)

    def _maybe_rebuild(self, buf: torch.Tensor, n: list[int]) -> None:
        """Before a round, per row, Session._maybe_rebuild's rule: rebuild when new tokens crowd the budget
        (Speculation.rebuild_after: with padding while other rows are live) or number `rebuild_every`, or
        when the row's rolling acceptance of the middle level falls under `rebuild_below`."""
        if self.retrieval is None:
            return
        s = self.spec
        self.full.sync(buf, n)  # drop each row's rejected tail: rebuild from committed tokens
        new = [self.full.held(i) - int(self.retrieval.base[i]) for i in range(len(self.rows.ids))]
        stats = self.middle_level.stats
        after = s.rebuild_after(len(self.rows.ids))
        stale = [i for i, r in enumerate(self.rows.ids) if new[i] >= after or stats.low(r, s.rebuild_below)]
        if stale:
            self._rebuild(stale, buf)
            for i in stale:
                self.rows.rebuilds[self.rows.ids[i]] += 1

    def round(self, gen) -> list[list[int]]:
        """Every live row's new tokens of one round of the top level."""
        buf, n = self._buffer()
        self._maybe_rebuild(buf, n)
        tokens, _ = self.top.round(buf, n, gen, [True] * len(n))
        for r in self.rows.ids:
            self.rows.verified[r] += 1
        return tokens

    def keep(self, live: list[int]) -> None:
        """Only the live rows stay, in the caches and in the host state."""
        self.rows.ids[:] = [self.rows.ids[i] for i in live]
        for node in self.nodes():
            node.keep(live)

    def counts(self) -> dict[str, tuple[int, float]]:
        """(forwards run so far, seconds in them) per node, by node name, as Session.counts."""
        return {node.name: (node.forwards, node.timer.seconds()) for node in self.nodes()}

    def stats(self, r: int, prefill_s: float, decode_s: float, before: dict | None = None) -> dict:
        """Prompt r's statistics, with engine._stats's names: the batch's (prefill_s, decode_s, batch_size,
        batch_tokens_per_s, ms_per_token, prefill_rebuild_s, rebuild_s) and the row's own (verifications,
        tokens_per_verification, acceptance, rebuilds)."""
        n_all, n_out, verified = sum(len(o) for o in self.rows.out), len(self.rows.out[r]), self.rows.verified[r]
        retrieval = self.retrieval is not None

        def acc(level):
            return None if level is None else level.stats.acceptance(r)

        return {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            # the batch's forwards per node while decoding, and seconds in them (engine._stats's names)
            **({"forwards": {k: n - before[k][0] for k, (n, _) in self.counts().items()},
                "stage_s": {k: s - before[k][1] for k, (_, s) in self.counts().items()}} if before else {}),
            "batch_size": len(self.rows.out),
            "batch_tokens_per_s": n_all / decode_s if n_all and decode_s > 0 else None,
            "ms_per_token": 1000 * decode_s / n_all if n_all else None,  # the batch's: all rows' tokens
            "verifications": verified,
            "tokens_per_verification": n_out / verified if verified else None,
            "acceptance": {"draft": acc(self.draft_level), "retrieval": acc(self.middle_level)},
            # Retrieval rebuilds, seconds for the batch (rows rebuilt together share one call): the prefill's
            # (within prefill_s), then all rows' during decoding (within decode_s); rebuilds counts the row's.
            "prefill_rebuild_s": self.rebuild_times[0] if retrieval else None,
            "rebuild_s": sum(self.rebuild_times[1:]) if retrieval else None,
            "rebuilds": self.rows.rebuilds[r] if retrieval else None,
        }
