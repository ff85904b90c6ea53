"""Session: the caches and levels of one generation over one prompt, built from the memory plan, and
their lifecycle (prefill, rebuilds of the retrieval cache, rounds, rewinding to a mark). engine.py
drives it (generate, decode, statistics); conversation.py keeps one across questions.
"""
from __future__ import annotations

import time

import psutil
import torch

from . import placement
from .attention import flash_attn_func
from .cache import FullCache, RetrievalCache, StreamingCache
from .cache.offload import OffloadedCache
from .cache.policies import make_select
from .config import Sampling, Speculation
from .graphs import GraphRunner
from .levels import Drafter, LevelStats, Node, SpecLevel
from .prefill import prefill_layer_major
from .rope import Rotary
from .rowwise import RowwiseRunner
from .vocab import shared_vocabulary


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Session:
    """The caches and levels of one generation over one prompt."""

    def __init__(self, target, draft, prompt_len: int, max_new: int, spec: Speculation, sampling: Sampling,
                 prefill_chunk: int = 512, offload: str = "auto", gpu_memory: int | None = None,
                 cuda_graphs: bool = True, device_free: int | None = None, deterministic: bool = False,
                 group=None):
        """group: the tensor-parallel ranks (parallel.Group), whose plans must agree before any cache exists."""
        self.target, self.draft = target, draft
        cfg = target.config
        self.total = prompt_len + max_new
        capacity = spec.capacity(self.total)
        spec = spec.fitted(capacity)
        self.spec, self.sampling = spec, sampling
        self.seq = torch.zeros(capacity, dtype=torch.long)
        self.buffer = self.seq[None]  # the levels' (B, capacity) buffer: one row, a view of seq
        p = next(target.parameters())
        dims = (cfg.num_hidden_layers, target.n_kv_heads, target.head_dim)
        rotary = Rotary(cfg, max_len=self.total, device=p.device)
        cuda = p.device.type == "cuda"
        flash = cuda and flash_attn_func is not None and p.dtype != torch.float32  # attention.flash_usable
        graphs = cuda_graphs and cuda
        kernel = "flash" if flash else "sdpa" if cuda else "math"
        work = placement.Work.of(spec, capacity, prompt_len - 1, prefill_chunk, graphs, kernel)
        self.plan = _plan(target, draft, work, offload, gpu_memory, device_free)
        if group is not None:
            group.check_plan(self.plan)
        pool = torch.cuda.graph_pool_handle() if graphs else None  # one pool for every GraphRunner
        if self.plan.resident == self.plan.n_layers:
            full = FullCache(*dims, capacity=capacity, rotary=rotary, dtype=p.dtype, device=p.device)
        else:
            full = OffloadedCache(*dims, capacity=capacity, rotary=rotary, resident=self.plan.resident,
                                  dtype=p.dtype, device=p.device)
        # deterministic: verify row by row, exactly as one-token decoding computes each logit (rowwise.py)
        self.full = Node("full", target, full, sampling, capacity, prefill_chunk,
                         RowwiseRunner(target, full) if deterministic else None)
        self.middle = self.small = self.retrieval = None
        method = spec.method
        if method in ("triforce", "retrieval"):
            self.retrieval = RetrievalCache(*dims, budget=spec.budget, chunk_size=spec.chunk_size,
                                            rotary=rotary, dtype=p.dtype, device=p.device,
                                            select=make_select(spec.policy, spec.sinks),
                                            shared=spec.policy == "shared",
                                            recompute_stats=self.plan.recompute_stats)
            self.middle = Node("retrieval", target, self.retrieval, sampling, capacity, prefill_chunk,
                               _runner(target, self.retrieval, graphs, pool))
        elif method == "streaming":
            cache = StreamingCache(*dims, budget=spec.budget, sinks=spec.sinks, rotary=rotary,
                                   max_rollback=spec.max_lookahead, max_new=prefill_chunk + spec.max_lookahead,
                                   dtype=p.dtype, device=p.device)
            self.middle = Node("streaming", target, cache, sampling, capacity, prefill_chunk,
                               _runner(target, cache, graphs, pool))
        if spec.uses_draft:
            dcfg, dp = draft.config, next(draft.parameters())
            chunk = min(prefill_chunk, spec.draft_budget)
            cache = StreamingCache(dcfg.num_hidden_layers, draft.n_kv_heads, draft.head_dim,
                                   budget=spec.draft_budget, sinks=spec.sinks,
                                   rotary=Rotary(dcfg, max_len=self.total, device=dp.device),
                                   max_rollback=spec.max_lookahead, max_new=chunk + spec.max_lookahead,
                                   dtype=dp.dtype, device=dp.device)
            self.small = Node("draft", draft, cache, sampling, capacity, chunk, _runner(draft, cache, graphs, pool),
                              shared_vocabulary(draft, cfg.vocab_size))
        self.top, self.draft_level, self.middle_level = self._compose()

    def _compose(self):
        """Returns (top level, level verifying the small draft, level verifying the middle level)."""
        s = self.spec
        if s.method == "ar":
            return Drafter(self.full), None, None
        if s.method == "naive":
            top = SpecLevel(Drafter(self.small), self.full, s.gamma2)
            return top, top, None
        if s.method == "retrieval":
            top = SpecLevel(Drafter(self.middle), self.full, s.gamma2)
            return top, None, top
        mid = SpecLevel(Drafter(self.small), self.middle, s.gamma1)
        top = SpecLevel(mid, self.full, s.gamma2)
        return top, mid, top

    def prefill(self, prompt: torch.Tensor, progress=None, upto: int | None = None) -> int:
        """Every node takes the prompt but its last token, which the first round feeds (with upto: takes
        prompt[:upto], e.g. a document that questions will follow). What the caches already hold of it (a
        conversation's document, a loaded snapshot) is kept and only the rest is fed; returns how many
        tokens the full cache kept."""
        n = len(prompt)
        m = n - 1 if upto is None else upto
        self.seq[:n] = prompt
        [kept] = self.full.sync(self.buffer, [m + 1])
        if self.retrieval is not None:
            self.retrieval.forget_rows(kept)  # what the full cache holds from `kept` on is fed again
        if isinstance(self.full.cache, OffloadedCache) and kept == 0 and m > 0:
            # PCIe traffic linear in the prompt
            chunk_rule = self.retrieval is not None and self.retrieval.select is None
            observe = (lambda i, k: self.retrieval.observe(self.full.cache, i, k)) if chunk_rule else None
            prefill_layer_major(self.target, [self.seq[:m]], self.full.cache, self.full.prefill_chunk, progress,
                                observe)
            self.full.adopt(self.buffer, [m])
        else:
            self.full.prefill(self.buffer, [m], progress)
        if self.middle is not None:
            if self.retrieval is not None:
                prepare = getattr(self.retrieval.select, "prepare", None)  # H2O: a pass over the prompt
                if prepare is not None:
                    prepare(self.target, self.seq[:m])
                self._rebuild()
            else:
                self._catch_up(self.middle, m)
        if self.small is not None:
            self._catch_up(self.small, m)
        self._capture_graphs()
        return kept

    def _capture_graphs(self) -> None:
        """Right after prefill, outside the timed decode: the graphs of the draft and middle levels'
        decode forwards. A drafter feeds 1 token (2 after a fully accepted round); the middle level
        verifying gamma1 drafts feeds gamma1 + 1. For the retrieval cache only its first forward's shape:
        a capture writes the slots of the positions it covers, and only that forward is sure to write
        them again before reading (GraphRunner.capture)."""
        shapes = {}
        if self.small is not None:
            shapes[self.small] = [(1, 1), (2, 1)]
        if self.spec.method == "triforce":
            shapes[self.middle] = [(self.spec.gamma1 + 1, self.spec.gamma1 + 1)]
        elif self.middle is not None:
            shapes[self.middle] = [(1, 1)] if self.retrieval is not None else [(1, 1), (2, 1)]
        for node, node_shapes in shapes.items():
            if isinstance(node.runner, GraphRunner):
                for n_tokens, last_n in node_shapes:
                    node.runner.capture(n_tokens, last_n)

    # Returning to a prefix (a document's end): the full cache truncates, the retrieval cache is rebuilt,
    # and a streaming cache, which rolls back only max_rollback tokens, restores the state marked there.
    marks: dict = {}  # node name -> (StreamingCache.state(), the tokens it holds)
    loaded_queries: tuple | None = None  # (length, per layer (H_q, D)): the last prefix token's, from a snapshot

    def _streaming_nodes(self) -> list[Node]:
        return [node for node in (self.middle, self.small) if node is not None and node.cache is not self.retrieval]

    def mark(self, prefix: torch.Tensor | None = None) -> None:
        """Remember the streaming caches' states at what they hold now, for later prompts that extend it;
        with prefix (a conversation's history), at what they hold of it: the speculation they hold beyond
        it (within their reach) is rolled back first."""
        marks = dict(self.marks)
        if prefix is not None:
            self.seq[:len(prefix)] = prefix
        for node in self._streaming_nodes():
            keep = node.cache.length if prefix is None else node.matching(self.buffer, [len(prefix) + 1])[0]
            if node.cache.reachable(keep):  # else the earlier mark stays
                node.cache.truncate(keep)
                marks[node.name] = (node.cache.state(), node.tokens[0, :keep].clone())
        self.marks = marks

    def rewind(self, n: int) -> None:
        """Back to (at most) the prefix seq[:n] after a generation stopped at any point (an exception,
        Ctrl-C), whatever it left half-done: the full cache keeps at most n tokens (it only ever wrote
        prefix tokens below n), the streaming caches take their marked states (marked within the prefix);
        the next prefill rebuilds the retrieval cache from the full cache."""
        self.full.cache.truncate(min(self.full.cache.length, n))
        for node in self._streaming_nodes():
            state, tokens = self.marks.get(node.name, (None, self.seq[:0]))
            node.cache.restore(state)
            node.adopt(tokens[None], [len(tokens)])

    def _catch_up(self, node: Node, m: int) -> None:
        """Feed a streaming node seq[:m]: rolled back within reach, else from the marked state if seq extends
        it, else from the start."""
        if not node.cache.reachable(node.matching(self.buffer, [m + 1])[0]):
            state, tokens = self.marks.get(node.name, (None, self.seq[:0]))
            usable = state is not None and len(tokens) <= m and torch.equal(tokens, self.seq[:len(tokens)])
            node.cache.restore(state if usable else None)
            node.adopt(self.buffer, [node.cache.length])
        node.prefill(self.buffer, [m])

    def resample(self, sampling: Sampling) -> None:
        """Draw the next generations from `sampling` (a server's per-request temperature and top-p): every
        node turns logits into probabilities with it (levels.Node), at every level alike."""
        self.sampling = sampling
        for node in (self.small, self.middle, self.full):
            if node is not None:
                node.sampling = sampling

    def counts(self) -> dict[str, tuple[int, float]]:
        """(forwards run so far, seconds in them) per node, by node name (draft; retrieval or streaming;
        full). On CUDA, after synchronising the device (timing.py)."""
        return {node.name: (node.forwards, node.timer.seconds())
                for node in (self.small, self.middle, self.full) if node is not None}

    def reset_stats(self) -> None:
        """Acceptance and rebuild times count from here (a conversation's next question)."""
        for level in {self.draft_level, self.middle_level} - {None}:
            level.stats = LevelStats(1, level.window)
        self.rebuild_times = ()

    rebuild_times: tuple[float, ...] = ()  # seconds of each retrieval rebuild, the prefill's first

    def _rebuild(self) -> None:
        full = self.full.cache
        L = full.length
        device = next(self.target.parameters()).device
        _sync_device(device)  # time the rebuild alone, not the work queued before it
        t0 = time.perf_counter()
        queries = self.last_queries(L) if L else []
        self.retrieval.rebuild(full, [0], [queries])
        _sync_device(device)
        self.rebuild_times += (time.perf_counter() - t0,)
        self.middle.adopt(self.buffer, [L])
        if self.middle_level is not None:
            self.middle_level.stats.recent[0] = []

    def last_queries(self, L: int) -> list[torch.Tensor]:
        """Per layer, the rotated query (H_q, D) of the last committed token, from the full cache's last
        forward; a snapshot's saved ones after loading; else that token is fed again to compute them."""
        full = self.full.cache
        queries = full.query_at(0, L - 1)
        if queries is None:
            if self.loaded_queries is not None and self.loaded_queries[0] == L:
                return self.loaded_queries[1]
            full.truncate(L - 1)
            self.full.prefill(self.buffer, [L])
            queries = full.query_at(0, L - 1)
        return queries

    def _maybe_rebuild(self, n: int) -> None:
        """Before a round over seq[:n]: rebuild when new tokens crowd the budget, every `rebuild_every`
        tokens, or when the middle level's rolling acceptance falls under `rebuild_below`."""
        if self.retrieval is None:
            return
        self.full.sync(self.buffer, [n])  # drop the full cache's rejected tail: rebuild from committed tokens
        new = self.full.cache.length - int(self.retrieval.base[0])
        low = self.middle_level.stats.low(0, self.spec.rebuild_below)
        if new >= self.spec.rebuild_after() or low:
            self._rebuild()

    def round(self, n: int, gen: torch.Generator) -> list[int]:
        self._maybe_rebuild(n)
        tokens, _ = self.top.round(self.buffer, [n], gen)
        return tokens[0]


def _runner(model, cache, enabled: bool, pool):
    """CUDA graphs for the draft and middle levels' forwards (never the full cache's)."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    return GraphRunner(model, cache, pool) if enabled and on_cuda else None


def model_shape(model) -> placement.Shape:
    """placement.Shape of a built model as it is (a tensor-parallel rank's shard included), its weights
    counted from its parameters."""
    layer = model.model.layers[0]
    params = {p.data_ptr(): p.nbytes for p in model.parameters()}  # tied embeddings once
    p = next(model.parameters())
    return placement.Shape(len(model.model.layers), model.config.hidden_size, layer.mlp.gate_proj.out_features,
                           layer.self_attn.n_heads, model.n_kv_heads, model.head_dim, model.config.vocab_size,
                           p.element_size(), sum(params.values()))


def _plan(target, draft, work: placement.Work, offload: str, gpu_memory: int | None,
          device_free: int | None = None) -> placement.Plan:
    """The memory plan of this generation. Device budget, for everything including the CUDA context: on
    CUDA, the device's memory (what is allocated now, the context, what is free), capped by gpu_memory;
    with device_free, what is loaded now plus device_free (a CPU run then plans as if a device had that
    room beside the weights); a CPU run without it: no device, everything in place."""
    shape = model_shape(target)
    small = model_shape(draft) if draft is not None and work.uses_draft else None
    loaded = shape.weights + (small.weights if small else 0)
    host_free = psutil.virtual_memory().available
    dev = next(target.parameters()).device
    context, budget = 0, None
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        reserved = torch.cuda.memory_reserved(dev)
        context = total - free - reserved  # the CUDA context and other processes' memory
        room = device_free if device_free is not None else free + reserved - torch.cuda.memory_allocated(dev)
        budget = loaded + context + room
    elif device_free is not None:
        budget = loaded + device_free
    if budget is not None and gpu_memory is not None:
        budget = min(budget, gpu_memory)
    return placement.plan(shape, work, offload, budget, host_free, small, context)
