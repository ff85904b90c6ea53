"""Session: the caches and levels of one generation over B rows (one prompt: B = 1), the caches built by
nodes.py from the memory plan, and their lifecycle (prefill, rebuilds of the retrieval cache, rounds,
compaction of finished rows, rewinding one row to a mark). driver.py runs the rounds for engine.generate
(one row), batch.generate_batch (a row per prompt), conversation.py (one row kept across questions) and a
server's requests. The row rules: docs/architecture.md.
"""
from __future__ import annotations

import time

import torch

from ..cache.offload import OffloadedCache
from ..config import RunConfig, Sampling
from ..errors import TforceError
from ..transfer import host
from .graphs import GraphRunner
from .nodes import build_nodes
from .levels import Drafter, LevelStats, SpecLevel
from .node import Node
from .prefill import prefill_layer_major
from .sampling import sample


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Session:
    """The caches and levels of one generation over `rows` prompts, one cache row each."""

    def __init__(self, target, draft, prompt_len: int, max_new: int, config: RunConfig, group=None, rows: int = 1):
        """prompt_len + max_new: the longest row's tokens (rows: its prompt and budget need not be the
        same row's); of `config` (checked), the speculation, the sampling and the execution options.
        group: the tensor-parallel ranks (parallel.Group), whose plans must agree before any cache exists."""
        self.target, self.draft = target, draft
        self.total = prompt_len + max_new
        capacity = config.speculation.capacity(self.total)
        spec, sampling, run = config.speculation.fitted(capacity), config.sampling, config.execution
        self.spec, self.sampling = spec, sampling
        self.buffer = torch.zeros(rows, capacity, dtype=torch.long)  # the levels' (B, capacity) sequences
        self.seq = self.buffer[0]  # the first row's, a view (conversations and snapshots are one row's)
        self.ids = list(range(rows))  # live row i is prompt ids[i] (Session.keep compacts them)
        self.verified = [0] * rows  # per prompt: rounds of the top level that decided its tokens
        self.logprobs = None  # record_logprobs: the last round's raw log-probabilities, per live row
        self.next: torch.Tensor | None = None  # (live rows, V): the first tokens' distributions (Session.round)
        self.rebuilds = [0] * rows  # per prompt: retrieval rebuilds while decoding
        built = build_nodes(target, draft, prompt_len, self.total, capacity, spec, sampling, run, rows, group)
        self.plan, self.full, self.middle, self.small = built.plan, built.full, built.middle, built.small
        self.retrieval, self.lookup = built.retrieval, built.lookup
        self.top, self.verifies_draft, self.verifies_middle = self._compose()

    def _compose(self):
        """The levels of Speculation.hierarchy(): returns (top level, verifies_draft: the level verifying the
        bottom level (a small draft, or lookup), verifies_middle: the level verifying the middle level); None
        where the method has no such level."""
        nodes = {"full": self.full, "draft": self.small, self.spec.middle: self.middle}
        verifies = {}

        def build(level: tuple):
            if level[0] == "lookup":
                return self.lookup
            if level[0] == "drafter":
                return Drafter(nodes[level[1]])
            _, proposer, node, gamma = level
            spec = SpecLevel(build(proposer), nodes[node], gamma, self.ids, len(self.verified))
            of_middle = proposer[0] == "spec" or proposer == ("drafter", self.spec.middle)
            verifies["middle" if of_middle else "draft"] = spec
            return spec

        top = build(self.spec.hierarchy())
        return top, verifies.get("draft"), verifies.get("middle")

    def nodes(self) -> list[Node]:
        return [node for node in (self.small, self.middle, self.full) if node is not None]

    def prefill(self, prompts, progress=None, upto: list[int] | None = None) -> list[int]:
        """Row b takes prompts[b] (token ids: a list or a 1-D tensor) in every node, and `next` holds each
        row's distribution of the token after it: the full cache's forward that feeds the prompt's last
        token yields it, so the first new token costs no pass over the cache of its own (Session.round).
        With upto: row b takes prompts[b][:upto[b]] and no `next` (e.g. a document that questions will
        follow). What the caches already hold of it (a conversation's document, a loaded snapshot) is kept
        and only the rest is fed (at least the last token, for `next`); returns how many tokens each row of
        the full cache kept."""
        first = upto is None
        m = [len(p) for p in prompts] if first else list(upto)
        for b, p in enumerate(prompts):
            self.buffer[b, :len(p)] = torch.as_tensor(p, dtype=torch.long)
        kept = self.full.match_prefix(self.buffer, m if first else [x + 1 for x in m])
        if self.retrieval is not None:
            for b, k in enumerate(kept):
                self.retrieval.forget_rows(k, b)  # what the full cache holds from `k` on is fed again
        full = self.full.cache
        if isinstance(full, OffloadedCache) and not any(kept) and max(m) > 0:
            # PCIe traffic linear in the prompts (prefill.py)
            chunk_rule = self.retrieval is not None and self.retrieval.select is None
            observe = (lambda i, k: self.retrieval.observe(full, i, k, m)) if chunk_rule else None
            done = prefill_layer_major(self.target, [self.buffer[b, :mb] for b, mb in enumerate(m)], full,
                                       self.full.prefill_chunk, progress, observe, rowwise=self.full.counted)
            self.full.adopt(self.buffer, m)
            self.next = self.full.next_of(done.last) if first else None
        elif first:
            _, self.next = self.full.prefill_next(self.buffer, m, progress)
        else:
            self.full.prefill(self.buffer, m, progress)
            self.next = None
        if self.middle is not None:
            if self.retrieval is not None:
                prepare = getattr(self.retrieval.select, "prepare", None)  # H2O: a pass over each row's prompt
                if prepare is not None:
                    for b, mb in enumerate(m):  # each row's scores from its own prompt: it selects as alone
                        prepare(self.target, self.buffer[b, :mb], b)
                self._rebuild(list(range(len(m))))
            else:
                self._catch_up(self.middle, m)
        if self.small is not None:
            self._catch_up(self.small, m)
        if self.lookup is not None:  # index the prompts now, not in the first round's time
            self.lookup.prefill(self.buffer, m)
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
        if self.spec.two_verifiers and self.retrieval is not None:  # triforce: the middle verifies gamma1 tokens
            shapes[self.middle] = [(self.spec.gamma1 + 1, self.spec.gamma1 + 1)]
        elif self.middle is not None:
            shapes[self.middle] = [(1, 1)] if self.retrieval is not None else [(1, 1), (2, 1)]
        for node, node_shapes in shapes.items():
            if isinstance(node.runner, GraphRunner):
                for n_tokens, last_n in node_shapes:
                    node.runner.capture(n_tokens, last_n)

    # Returning one row to a prefix (a document's end): the full cache truncates, the retrieval cache is
    # rebuilt, and a streaming cache, which rolls back only max_rollback tokens, restores the state marked
    # there. Conversations and snapshots are one row's: the marks are row 0's.
    marks: dict = {}  # node name -> (StreamingCache.state(), the tokens it holds)
    loaded_queries: tuple | None = None  # (length, per layer (H_q, D)): the last prefix token's, from a snapshot

    def adopt_prefix(self, tokens: torch.Tensor, counts: list[int], queries: list | None = None) -> None:
        """The full cache was just written with counts[b] tokens of tokens (B, L) for each row b (a snapshot
        loaded: snapshot/store.py): the full level takes them as fed. queries: per layer, row 0's at its last
        token, for the first retrieval rebuild (_query); None when the snapshot has none or row 0 stops short."""
        self.full.adopt(tokens, counts)
        if queries is not None:
            self.loaded_queries = (counts[0], queries)

    def streaming_nodes(self) -> list[Node]:
        """The levels whose caches are StreamingLLM windows (the small draft, a streaming middle level)."""
        return [node for node in (self.middle, self.small) if node is not None and node.cache is not self.retrieval]

    def mark(self, prefix: torch.Tensor | None = None) -> None:
        """Remember the streaming caches' states at what they hold now, for later prompts that extend it;
        with prefix (a conversation's history), at what they hold of it: the speculation they hold beyond
        it (within their reach) is rolled back first."""
        marks = dict(self.marks)
        if prefix is not None:
            self.seq[:len(prefix)] = prefix
        for node in self.streaming_nodes():
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
        for node in self.streaming_nodes():
            state, tokens = self.marks.get(node.name, (None, self.seq[:0]))
            node.cache.restore(state)
            node.adopt(tokens[None], [len(tokens)])

    def _catch_up(self, node: Node, m: list[int]) -> None:
        """Feed a streaming node buffer[b, :m[b]]. One row: rolled back within reach, else from the marked
        state if seq extends it, else from the start (a batch's rows start empty: nothing to restore)."""
        if len(m) == 1 and not node.cache.reachable(node.matching(self.buffer, [m[0] + 1])[0]):
            state, tokens = self.marks.get(node.name, (None, self.seq[:0]))
            usable = state is not None and len(tokens) <= m[0] and torch.equal(tokens, self.seq[:len(tokens)])
            node.cache.restore(state if usable else None)
            node.adopt(self.buffer, [node.cache.length])
        node.prefill(self.buffer, m)

    def resample(self, sampling: Sampling) -> None:
        """Draw the next generations from `sampling` (a server's per-request temperature and top-p): every
        node turns logits into probabilities with it (node.Node), at every level alike."""
        self.sampling = sampling
        for node in (self.small, self.middle, self.full):
            if node is not None:
                node.sampling = sampling

    def counts(self) -> dict[str, tuple[int, float, int]]:
        """(forwards run so far, seconds in them, rows they fed) per node, by node name (draft; retrieval or
        streaming; full). On CUDA, after synchronising the device (timing.py)."""
        return {node.name: (node.forwards, node.timer.seconds(), node.row_forwards) for node in self.nodes()}

    def reset_stats(self) -> None:
        """Acceptance, rounds and rebuilds count from here (a conversation's next question)."""
        P = len(self.verified)
        for level in {self.verifies_draft, self.verifies_middle} - {None}:
            level.stats = LevelStats(P, level.window)
        self.verified, self.rebuilds = [0] * P, [0] * P
        self.rebuild_times = ()

    rebuild_times: tuple[float, ...] = ()  # seconds of each retrieval rebuild (all its rows), the prefill's first

    def _rebuild(self, live: list[int]) -> None:
        """Rebuild the listed live rows' retrieval caches from what the full cache holds of each row."""
        device = self.full.device
        sync_device(device)  # time the rebuild alone, not the work queued before it
        t0 = time.perf_counter()
        lengths = [self.full.held(i) for i in live]
        missing = tuple(i for i, L in zip(live, lengths) if L and self._query(i, L) is None)
        if missing:  # feed those rows' last tokens again, for their queries
            self.full.prefill(self.buffer, [self.full.held(i) for i in range(len(self.ids))], refeed=missing)
        queries = [self._query(i, L) if L else [] for i, L in zip(live, lengths)]
        self.retrieval.rebuild(self.full.cache, live, queries)
        self.middle.adopt(self.buffer[live], lengths, live)
        if self.verifies_middle is not None:
            for i in live:
                self.verifies_middle.stats.recent[self.ids[i]] = []
        sync_device(device)
        self.rebuild_times += (time.perf_counter() - t0,)

    def _query(self, b: int, L: int) -> list[torch.Tensor] | None:
        """Per layer, row b's rotated query (H_q, D) at its last committed token L - 1: from the full cache's
        last forward, or (row 0) a loaded snapshot's; None when neither holds it."""
        queries = self.full.cache.query_at(b, L - 1)
        if queries is None and b == 0 and self.loaded_queries is not None and self.loaded_queries[0] == L:
            return self.loaded_queries[1]
        return queries

    def last_queries(self, L: int) -> list[torch.Tensor]:
        """Row 0's _query at L, its last token fed again when it is not at hand (a snapshot's save)."""
        if self._query(0, L) is None:
            self.full.prefill(self.buffer, [L], refeed=(0,))
        return self._query(0, L)

    def _maybe_rebuild(self, n: list[int]) -> None:
        """Before a round over buffer[i, :n[i]], per row: rebuild when new tokens crowd the budget
        (Speculation.rebuild_after) or number `rebuild_every`, or when the row's rolling acceptance of the
        middle level falls under `rebuild_below`."""
        if self.retrieval is None:
            return
        s, stats = self.spec, self.verifies_middle.stats
        self.full.match_prefix(self.buffer, n)  # drop each row's rejected tail: rebuild from committed tokens
        after = s.rebuild_after()
        stale = [i for i, r in enumerate(self.ids)
                 if self.full.held(i) - self.retrieval.base[i] >= after or stats.low(r, s.rebuild_below)]
        if stale:
            self._rebuild(stale)
            for i in stale:
                self.rebuilds[self.ids[i]] += 1

    def record_logprobs(self, on: bool) -> None:
        """From the next prefill on, `logprobs` holds after each round the raw log-probabilities (the target's
        log-softmax, before temperature and top-p/top-k) of each live row's new tokens' positions: one row (k,
        V) per token, from the forwards that decided them (no extra pass). One row only: a prefill over several
        rows takes their last logits from different chunks."""
        if on and len(self.buffer) != 1:
            raise TforceError("log-probabilities are recorded for a session of one row")
        self.full.raw, self.logprobs = on, None

    def _first(self, n: list[int], gen: torch.Generator) -> list[list[int]]:
        """Every live row's first new token, drawn from the prefill's distribution of it (`next`) and
        written at buffer[i, n[i]]: exactly the target's, as every round's tokens are."""
        tokens = host(sample(self.next, gen, self.sampling.greedy))
        self.logprobs = list(self.full.logprobs[:, -1:]) if self.full.raw else None  # the prefill's last forward
        self.next = None
        for i, t in enumerate(tokens):
            self.buffer[i, n[i]] = t
        return [[t] for t in tokens]

    def round(self, n: list[int], gen: torch.Generator) -> list[list[int]]:
        """Every live row's new tokens after buffer[i, :n[i]] (written there): the first round after a prefill
        draws one token per row from the prefill's distributions (_first), the others run the top level."""
        if self.next is not None:
            return self._first(n, gen)
        self._maybe_rebuild(n)
        tokens, _ = self.top.round(self.buffer, n, gen)
        self.logprobs = self.top.logprobs if self.full.raw else None
        for r in self.ids:
            self.verified[r] += 1
        return tokens

    def admit(self, prompt, gen: torch.Generator) -> tuple[int, int]:
        """A new prompt joins the running rows between rounds (a server's request joining its batch) as live
        row len(ids), in a row the caches hold free (keep compacted the finished ones away), and prompt index
        r: a finished prompt's, counted again from nothing, or the next. Every node prefills the row alone
        (the other rows sit out where the cache allows, else they are fed padding: an offloaded full
        cache), as the prompt's own prefill would, but for the longest prefix of it (but its last token) a live
        row's full cache holds: those K/V are copied (as a one-row session reuses what an earlier prompt left:
        serve/worker.py). The row's first new token is drawn now from the prefill's distribution and written
        after the prompt. Returns (r, the prompt tokens whose K/V were copied); the row's first token is
        buffer[len(ids) - 1, len(prompt)]."""
        if self.next is not None:
            raise TforceError("a row joins between rounds, not before the first")
        b, m = len(self.ids), len(prompt)
        if b >= len(self.buffer):
            raise TforceError(f"no free row: the session holds {len(self.buffer)}")
        free = sorted(set(range(len(self.verified))) - set(self.ids))
        r = free[0] if free else len(self.verified)
        if r == len(self.verified):
            self.verified.append(0)
            self.rebuilds.append(0)
        self.verified[r] = self.rebuilds[r] = 0
        for level in {self.verifies_draft, self.verifies_middle} - {None}:
            level.stats.clear(r)
        for node in self.nodes():
            assert node.add_row() == b
        self.ids.append(r)
        self.buffer[b, :m] = torch.as_tensor(prompt, dtype=torch.long)
        donor, shared = self._donor(b, m - 1)
        if shared:
            self.full.share_prefix(donor, b, shared)
        probs = self.full.fill_row(self.buffer, b, m, want=True)
        if self.middle is not None:
            if self.retrieval is not None:
                prepare = getattr(self.retrieval.select, "prepare", None)  # H2O: a pass over the row's prompt
                if prepare is not None:
                    prepare(self.target, self.buffer[b, :m], b)
                self._rebuild([b])
            else:
                self.middle.fill_row(self.buffer, b, m)
        if self.small is not None:
            self.small.fill_row(self.buffer, b, m)
        if self.lookup is not None:
            self.lookup.add_row(self.buffer, b, m)
        self.buffer[b, m] = host(sample(probs[None], gen, self.sampling.greedy))[0]
        return r, shared

    def _donor(self, b: int, m: int) -> tuple[int, int]:
        """(the live row whose full cache holds the longest prefix of buffer[b, :m], its length), or (0, 0)."""
        best = (0, 0)
        for i in range(b):
            n = min(self.full.held(i), m)
            diff = (self.full.tokens[i, :n] != self.buffer[b, :n]).nonzero()
            shared = int(diff[0]) if len(diff) else n
            if shared > best[1]:
                best = (i, shared)
        return best

    def keep(self, live: list[int]) -> None:
        """Only the listed live rows stay (increasing), moved to the front: in the caches, the nodes' records,
        the sequences and the row -> prompt map; a finished row costs no further work."""
        for node in self.nodes():
            node.keep(live)
        if self.lookup is not None:
            self.lookup.keep(live)
        if self.next is not None:
            self.next = self.next[live]
        self.buffer[:len(live)] = self.buffer[live]
        self.ids[:] = [self.ids[i] for i in live]

