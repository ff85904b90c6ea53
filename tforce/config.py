"""Run configuration: frozen dataclasses built once at the edge (CLI or API call) and passed down.

The network's own configuration is the Hugging Face config object (transformers parses it, including
every RoPE variant); everything here is what tforce adds on top.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from .errors import UsageError

METHODS = ("triforce", "ar", "retrieval", "streaming", "naive")
# The levels each method stacks under the full-cache verifier (docs/exactness.md): whether a small draft
# model proposes, and the middle level's cache ("retrieval", "streaming", or None without a middle level).
# Every rule that depends on the method reads it here, never from the method's name.
LEVELS = {"ar": (False, None), "naive": (True, None), "retrieval": (False, "retrieval"),
          "streaming": (True, "streaming"), "triforce": (True, "retrieval")}
assert sorted(LEVELS) == sorted(METHODS)


def levels(method: str) -> tuple[bool, str | None]:
    """LEVELS' entry of a method; "auto" and unknown names (refused by Speculation.validate): none."""
    return LEVELS.get(method, (False, None))
AUTO = "auto"  # not a method: chooser.py chooses one of METHODS (and its gammas) for the run
POLICIES = ("retrieval", "shared", "topk", "streaming", "h2o")
PROPOSERS = ("model", "lookup")  # Speculation.proposer  # the middle cache's selection rule (cache/policies.py)


@dataclass(frozen=True)
class Sampling:
    """The target distribution: the same transform is applied at every level."""

    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        if not 0 <= self.temperature < math.inf:  # also refuses nan
            raise UsageError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise UsageError(f"--seed must be in [-2**63, 2**64), got {self.seed}")


@dataclass(frozen=True)
class Speculation:
    method: str = "triforce"
    gamma1: int = 2  # small-draft tokens per middle-level verification
    gamma2: int = 6  # tokens per full-cache verification
    budget: int = 4096  # retrieval (or streaming, for method=streaming) cache size of the middle level
    chunk_size: int = 8
    draft_budget: int = 256  # StreamingLLM cache of the small draft: sinks + recent window
    sinks: int = 16
    rebuild_every: int = 128  # rebuild the retrieval cache after this many committed tokens
    rebuild_below: float = 0.3  # ... or when the middle level's rolling acceptance falls under this
    policy: str = "retrieval"  # which tokens the middle cache holds (methods triforce, retrieval)
    # what proposes at the bottom level of a method that has one: "model" (a small draft model) or "lookup"
    # (no model: what followed the latest earlier occurrence of the last n tokens, engine/lookup.py), n from
    # lookup_max down to lookup_min; with lookup_threshold > 0 a match drafts as many tokens as have, all of
    # them, at least that chance to come, from how matches of its size fared lately (0: every match drafts
    # gamma; engine/lookup.py, BENCHMARKS.md)
    proposer: str = "model"
    lookup_max: int = 3
    lookup_min: int = 1
    lookup_threshold: float = 0.0

    @property
    def drafts(self) -> bool:
        """The method has a bottom level that proposes (a draft model, or lookup)."""
        return levels(self.method)[0]

    @property
    def uses_draft(self) -> bool:
        """A small draft model proposes (the bottom level)."""
        return self.drafts and self.proposer == "model"

    @property
    def looks_up(self) -> bool:
        """The bottom level proposes by n-gram lookup, without a model."""
        return self.drafts and self.proposer == "lookup"

    @property
    def middle(self) -> str | None:
        """The middle level's cache kind: "retrieval" (triforce, retrieval), "streaming", or None."""
        return levels(self.method)[1]

    @property
    def retrieves(self) -> bool:
        """The middle level is a retrieval cache (what --policy, the budget's fitting and rebuilds act on)."""
        return self.middle == "retrieval"

    @property
    def two_verifiers(self) -> bool:
        """The bottom level is verified by a middle level (gamma1), which the full cache verifies (gamma2)."""
        return self.drafts and self.middle is not None

    def hierarchy(self) -> tuple:
        """The method's levels as nested tuples, top first: ("drafter", node) (one token per forward of that
        node's cache: "full", the middle kind, "draft"), ("lookup",) (n-gram lookup, no forward) or ("spec",
        proposer, verifying node, gamma). The engine builds its levels from it (engine/session.py) and the
        chooser projects their cost (auto/projection.py)."""
        bottom = ("lookup",) if self.looks_up else ("drafter", "draft")
        if not self.drafts and self.middle is None:  # ar
            return ("drafter", "full")
        if self.middle is None:  # naive
            return ("spec", bottom, "full", self.gamma2)
        if not self.drafts:  # retrieval, streaming
            return ("spec", ("drafter", self.middle), "full", self.gamma2)
        return ("spec", ("spec", bottom, self.middle, self.gamma1), "full", self.gamma2)

    def validate(self) -> None:
        if self.method == AUTO:  # the planner chooses among METHODS: every option is checked as triforce's
            return replace(self, method="triforce").validate()
        if self.method not in METHODS:
            raise UsageError(f"unknown method {self.method!r}; choose one of {', '.join((AUTO,) + METHODS)}")
        for name in ("gamma1", "gamma2", "budget", "chunk_size", "draft_budget", "rebuild_every"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.sinks < 0:
            raise UsageError(f"--sinks must be >= 0, got {self.sinks}")
        if self.chunk_size > self.budget:
            raise UsageError(f"--chunk-size ({self.chunk_size}) is larger than --budget ({self.budget})")
        if self.sinks >= self.draft_budget:
            raise UsageError(f"--sinks ({self.sinks}) must be smaller than --draft-budget ({self.draft_budget})")
        if self.middle == "streaming" and self.sinks >= self.budget:
            raise UsageError(f"--sinks ({self.sinks}) must be smaller than --budget ({self.budget})")
        if self.policy not in POLICIES:
            raise UsageError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.policy != "retrieval" and not self.retrieves:  # it would change nothing
            raise UsageError(f"--policy {self.policy} chooses what the middle level's cache holds; --method "
                             f"{self.method} has none (triforce and retrieval have)")
        if self.proposer not in PROPOSERS:
            raise UsageError(f"unknown proposer {self.proposer!r}; choose one of {', '.join(PROPOSERS)}")
        if not 1 <= self.lookup_min <= self.lookup_max:
            raise UsageError(f"--lookup-min and --lookup-max must satisfy 1 <= min <= max, got {self.lookup_min} "
                             f"and {self.lookup_max}")
        if not 0 <= self.lookup_threshold <= 1:
            raise UsageError(f"--lookup-threshold must be in [0, 1], got {self.lookup_threshold}")
        if not 0 <= self.rebuild_below <= 1:
            raise UsageError(f"--rebuild-below must be in [0, 1], got {self.rebuild_below}")

    def fitted(self, capacity: int) -> "Speculation":
        """This configuration for a generation whose caches hold `capacity` tokens: a retrieval budget
        larger than that is cut to the smallest number of whole chunks that still holds every token plus
        a lookahead of padding (batches) and a chunk. Why: the middle level attends over its whole buffer
        (masked), so a 4096-slot buffer for a 1,000-token context reads four times the keys the full
        cache does (benchmarks/cpu/2026-11-23_cpu_kv_bench.md). The same tokens are held either way."""
        if not self.retrieves:
            return self
        c = self.chunk_size
        enough = -(-(capacity + self.max_lookahead + c) // c) * c
        return replace(self, budget=min(self.budget, enough))

    @property
    def max_lookahead(self) -> int:
        """Most tokens any cache holds beyond the committed sequence within one full verification."""
        return self.gamma2 + self.gamma1 + 2

    def capacity(self, total: int) -> int:
        """Cache slots of a generation of `total` tokens (prompt and new): one verification's lookahead
        beyond them, and one."""
        return total + self.max_lookahead + 1

    def rebuild_after(self) -> int:
        """New committed tokens after which a row's retrieval cache is rebuilt before the next round (the one
        rule of session.Session._maybe_rebuild, for one row or many alike: padding overwrites nothing,
        cache/retrieval.py): rebuild_every, or fewer when one more verification's lookahead would crowd the
        budget (new + lookahead > budget - chunk_size)."""
        return min(self.rebuild_every, self.budget - self.chunk_size - self.max_lookahead + 1)


@dataclass(frozen=True)
class Execution:
    """How the forwards run and where the full KV cache lives (engine/placement.py plans it)."""

    prefill_chunk: int = 512  # prompt tokens per prefill forward
    offload: str = "auto"  # the full cache: "auto" on the device while it fits, "on" host memory, "off" device
    gpu_memory: int | None = None  # bytes tforce may use on the GPU (None: what is free)
    cuda_graphs: bool = True  # the draft and middle levels' forwards replayed as CUDA graphs (CUDA only)
    device_free: int | None = None  # the device's free bytes as the caller measured them (tensor-parallel
    # ranks pass their minimum, so that all plan alike; on a CPU run: plan as if a device had that room)
    deterministic: bool = False  # the full cache verifies row by row, bit for bit one-token decoding (rowwise.py)

    def validate(self) -> None:
        if self.prefill_chunk < 1:
            raise UsageError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.offload not in OFFLOAD_MODES:
            raise UsageError(f"--offload must be {', '.join(OFFLOAD_MODES)}, got {self.offload!r}")


OFFLOAD_MODES = ("auto", "on", "off")
_PARTS = {"speculation": Speculation, "sampling": Sampling, "execution": Execution}


@dataclass(frozen=True)
class RunConfig:
    """One generation's options, built once where they come in (the command line, a request, an API call)
    and handed down whole: the method and its budgets, the target distribution, how the forwards run, how
    many tokens, and KV snapshots (snapshot/format.py: load_kv a snapshot folder to start from, save_kv a
    folder to write the caches to after the prefill). Each option also has a flat name, the command line's
    without dashes (`RunConfig.of(method="ar", temperature=0)`)."""

    speculation: Speculation = Speculation()
    sampling: Sampling = Sampling()
    execution: Execution = Execution()
    max_new_tokens: int | tuple = 256  # a batch's may be one per prompt
    ignore_eos: bool = False  # keep going past the model's end-of-sequence tokens
    load_kv: object = None
    save_kv: object = None

    @classmethod
    def of(cls, **options) -> "RunConfig":
        """From flat option names; an unknown name is a TypeError, as an unknown keyword is."""
        return cls().with_options(**options)

    def with_options(self, **options) -> "RunConfig":
        """This configuration with the options of these flat names changed."""
        parts = {name: {} for name in _PARTS}
        own = {}
        for name, value in options.items():
            part = _OWNER.get(name)
            if part is None:
                raise TypeError(f"unknown option {name!r}; the options are {', '.join(sorted(_OWNER))}")
            if name == "max_new_tokens" and isinstance(value, list):
                value = tuple(value)  # one per prompt of a batch, kept hashable
            (own if part == "" else parts[part])[name] = value
        changed = {part: replace(getattr(self, part), **values) for part, values in parts.items() if values}
        return replace(self, **changed, **own)

    def options(self) -> dict:
        """Every option by its flat name (records, and calibration keys)."""
        out = {}
        for part in _PARTS:
            value = getattr(self, part)
            out.update({f.name: getattr(value, f.name) for f in fields(value)})
        return out | {name: getattr(self, name) for name in _OWN}

    @property
    def method(self) -> str:
        return self.speculation.method

    def validate(self) -> None:
        self.speculation.validate()
        self.sampling.validate()
        self.execution.validate()
        budgets = self.max_new_tokens if isinstance(self.max_new_tokens, tuple) else (self.max_new_tokens,)
        if budgets and min(budgets) < 0:
            raise UsageError(f"--max-new-tokens must be >= 0, got {min(budgets)}")


_OWN = ("max_new_tokens", "ignore_eos", "load_kv", "save_kv")
# flat option name -> the RunConfig part holding it ("": RunConfig itself)
_OWNER = {f.name: part for part, kind in _PARTS.items() for f in fields(kind)} | {name: "" for name in _OWN}
OPTIONS = tuple(_OWNER)  # every flat option name
