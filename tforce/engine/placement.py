"""The memory plan: every device allocation of one generation, itemised, and where the full KV cache lives.

One `Plan` object is read by the engine (how many layers of KV stay on the device), `tforce info` and
`tforce bench`. Its items are the bytes each part of a generation holds on one device (one rank under
tensor parallelism), tagged with the phase that holds them: the prefill peak and the decode peak are the
sums over the items live in that phase, and the plan's peak, the larger, must fit the device budget,
which is compared with everything, the CUDA context included. The full cache takes what is left: the
planner keeps as many of its layers on the device as the peak allows and the rest in pinned host memory
(allocated per layer and page-locked as is, without the caching allocator's power-of-two rounding, so
the host bytes checked are the bytes pinned).

The retrieval cache's chunk statistics (cache/chunkstats.py: float32 key sums, a quarter of the keys'
bfloat16 bytes) are given up before a layer is offloaded: when the plan with them kept does not fit, the
plan without them for the resident layers (`recompute_stats`: each rebuild sums those layers' chunks from
their keys on the device, bit-identical means) is tried with the same resident layers. Rebuilding so
reads a resident layer's keys once per rebuild, a device read every few tokens; offloading a layer
instead would move its KV over PCIe at every verification.

What is an estimate and says so: the CUDA context on paper (CONTEXT_BYTES; on a CUDA device the engine
measures it), CUDA graph pools (GRAPH_POOL_BYTES), and the activations of one forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model import families
from ..config import OFFLOAD_MODES, Speculation
from ..errors import DoesNotFit, UsageError

GiB = 1024 ** 3
MiB = 1024 ** 2
CONTEXT_BYTES = GiB // 2  # the CUDA context (kernels, cuBLAS workspaces) when no device is measured
GROUP = 32  # int4's group of inputs (model/quant.py)
GRAPH_POOL_BYTES = 256 * MiB  # estimate: the one pool the draft and middle levels' CUDA graphs share
LOGIT_COPIES = 4  # float32 (rows, vocab) tensors alive at once: logits, probabilities, sorted, residual


@dataclass(frozen=True)
class Shape:
    """One rank's share of a Llama model: local heads and MLP features, full hidden size and vocabulary."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    weights: int  # parameter bytes on this rank

    @classmethod
    def of(cls, config, dtype_bytes: int, world: int = 1, weights: str = "auto") -> "Shape":
        """From a Hugging Face config, for one of `world` tensor-parallel ranks; weights: the projections'
        form (weight_bytes)."""
        heads, kv, d = config.num_attention_heads, families.kv_heads(config), families.head_dim(config)
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size // world, heads // world,
                   kv // world, d, config.vocab_size, dtype_bytes, weight_bytes(config, dtype_bytes, world, weights))

    @property
    def layer_kv_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def weight_bytes(config, dtype_bytes: int, world: int = 1, weights: str = "auto") -> int:
    """Parameter bytes of a config of one of the families on one of `world` ranks, counted from its shapes
    (nothing is read): attention and MLP with their biases split over the ranks; embeddings, norms (Qwen3's
    q/k norms included) and lm_head replicated. weights "int8" / "int4": the layers' projections as
    model/quant.py holds them (int8: a byte a weight and a bfloat16 scale per output row; int4: half a byte
    a weight and a bfloat16 scale and zero per group of 32), everything else in the dtype."""
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    heads, kv, d = config.num_attention_heads, families.kv_heads(config), families.head_dim(config)
    parts = families.layout(config)
    qkv = (heads + 2 * kv) * d
    split = h * (qkv + heads * d) + 3 * h * i + parts.qkv_bias * qkv + parts.mlp_bias * 2 * i
    # o_proj's and down_proj's biases live on rank 0 only (sharding.py): counted on every rank, the largest
    whole = 2 * h + (parts.o_bias + parts.mlp_bias) * h + parts.qk_norm * 2 * d
    tied = getattr(config, "tie_word_embeddings", False)
    table = dtype_bytes * (h + v * h * (1 if tied else 2))
    if weights in ("int8", "int4"):
        proj, rows = h * (qkv + heads * d) + 3 * h * i, qkv + 2 * h + 2 * i
        coded = proj + 2 * rows if weights == "int8" else proj // 2 + proj // GROUP * 4
        bias = dtype_bytes * (split - proj)
        return n * ((coded + bias) // world + dtype_bytes * whole) + table
    layer = split // world + whole
    return dtype_bytes * n * layer + table


def kv_layer_bytes(n_kv: int, head_dim: int, capacity: int, dtype_bytes: int) -> int:
    return 2 * capacity * n_kv * head_dim * dtype_bytes


def n_chunks(capacity: int, chunk: int) -> int:
    return -(-capacity // chunk)


def chunk_stat_bytes(capacity: int, chunk: int, n_kv: int, head_dim: int) -> int:
    """One layer's retrieval chunk statistics: a float32 key sum per chunk and KV head."""
    return n_chunks(capacity, chunk) * n_kv * head_dim * 4


def streaming_capacity(budget: int, sinks: int, max_rollback: int, max_new: int) -> int:
    """Slots of a StreamingCache (cache/streaming.py): sinks, window + rollback, one forward's new tokens."""
    return sinks + (budget - sinks + max_rollback) + max_new


@dataclass(frozen=True)
class Work:
    """What one generation asks of the device: cache sizes and the shapes of its forwards."""

    capacity: int  # full-cache slots (prompt + new tokens + lookahead)
    prompt: int  # tokens prefilled (per row: the longest row's)
    spec: Speculation = Speculation()  # the levels, their caches' budgets and the gammas
    prefill_chunk: int = 512
    cuda_graphs: bool = True  # graphs of the draft and middle levels (CUDA only)
    # The attention kernel, for its scratch memory: "flash" (flash-attn: nothing beyond the cache's mask);
    # "sdpa" (PyTorch SDPA on CUDA, memory-efficient backend: the bool mask, folded per query-head group,
    # becomes an additive mask of the compute dtype; measured on an H100, benchmarks/gpu/*sdpa_probe*);
    # "math" (SDPA on the CPU: counted as materialising float32 scores, an upper bound).
    attention: str = "flash"
    rows: int = 1  # sequences decoded together (batch.py): every cache and activation is per row


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    phase: str  # "both", "prefill" or "decode"


@dataclass(frozen=True)
class Plan:
    n_layers: int
    resident: int  # layers whose KV stays on the device
    layer_bytes: int  # K + V of one layer at full capacity, all rows
    items: tuple[Item, ...] = ()
    budget: int | None = None  # device bytes allowed (None: no device)
    host_bytes: int = 0  # pinned host memory for the offloaded layers, exactly as allocated
    notes: dict = field(default_factory=dict)
    recompute_stats: bool = False  # no chunk statistics kept for resident layers (summed at each rebuild)

    @property
    def offloaded(self) -> int:
        return self.n_layers - self.resident

    @property
    def gpu_bytes(self) -> int:
        """The full cache's device share, staging buffers included."""
        return self.resident * self.layer_bytes + (2 * self.layer_bytes if self.offloaded else 0)

    def item(self, name: str) -> int:
        return sum(i.bytes for i in self.items if i.name == name)

    def phase_bytes(self, phase: str) -> int:
        return sum(i.bytes for i in self.items if i.phase in ("both", phase))

    @property
    def prefill_peak(self) -> int:
        return self.phase_bytes("prefill")

    @property
    def decode_peak(self) -> int:
        return self.phase_bytes("decode")

    @property
    def peak(self) -> int:
        return max(self.prefill_peak, self.decode_peak)

    def describe(self) -> str:
        """Where the full cache's layers go, to follow "KV cache: X GiB for N tokens, " (tforce info)."""
        if self.budget is None:  # planned for no device: everything stays where the model is
            return f"all {self.n_layers} layers in the CPU's memory (no GPU)"
        staging = " with the two staging buffers" if self.offloaded else ""  # gpu_bytes counts them
        return (f"{self.resident} of {self.n_layers} layers on the GPU ({self.gpu_bytes / GiB:.1f} GiB{staging}), "
                f"{self.offloaded} in pinned host memory ({self.host_bytes / GiB:.1f} GiB)")

    def as_dict(self) -> dict:
        return {"items": [{"name": i.name, "bytes": i.bytes, "phase": i.phase} for i in self.items],
                "prefill_peak_bytes": self.prefill_peak, "decode_peak_bytes": self.decode_peak,
                "peak_bytes": self.peak, "budget_bytes": self.budget, "resident_layers": self.resident,
                "offloaded_layers": self.offloaded, "host_pinned_bytes": self.host_bytes,
                "recompute_stats": self.recompute_stats, **self.notes}


def items(shape: Shape, work: Work, resident: int, draft: Shape | None = None,
          context: int = CONTEXT_BYTES, recompute_stats: bool = False) -> tuple[Item, ...]:
    """Every device allocation of one rank with `resident` layers of the full cache on the device (with
    recompute_stats, their chunk statistics not kept)."""
    s, w, e = shape, work, shape.dtype_bytes
    n, kv, d, b = s.layers, s.kv_heads, s.head_dim, work.rows
    layer = b * kv_layer_bytes(kv, d, w.capacity, e)
    offloaded = resident < n
    out = [Item("CUDA context", context, "both"),
           Item("target weights", s.weights, "both")]
    if w.spec.uses_draft and draft is not None:
        out.append(Item("draft weights", draft.weights, "both"))
    out += [Item("full KV, resident layers", resident * layer, "both"),
            Item("staging buffers (2 layers)", 2 * layer if offloaded else 0, "both")]
    ahead = w.spec.max_lookahead  # tokens a cache holds beyond the committed ones within a verification
    if w.spec.middle == "retrieval":
        chunks = n_chunks(w.capacity, w.spec.chunk_size)
        out += [Item("retrieval cache and key positions",
                     b * n * (kv_layer_bytes(kv, d, w.spec.budget + 1, e) + kv * (w.spec.budget + 1) * 8), "both"),
                # Each row's resident layers keep theirs on the device (unless recomputed); every rebuild
                # scores from one layer's means at a time (ChunkStats.means: a fresh device tensor, kept
                # statistics or not), the rows one after another: one scratch layer.
                Item("retrieval chunk statistics", (b * (0 if recompute_stats else resident) + 1)
                     * chunk_stat_bytes(w.capacity, w.spec.chunk_size, kv, d), "both"),
                # One layer at a time: budget rows of K and V gathered, their positions; float32 scores of
                # every layer (chunk_positions scores all layers before it selects).
                Item("rebuild scratch", kv_layer_bytes(kv, d, w.spec.budget, e) + 2 * kv * w.spec.budget * 8
                     + n * kv * chunks * 4, "decode")]
    elif w.spec.middle == "streaming":
        cap = streaming_capacity(w.spec.budget, w.spec.sinks, ahead, w.prefill_chunk + ahead)
        out.append(Item("middle StreamingLLM cache", b * n * kv_layer_bytes(kv, d, cap, e), "both"))
    if w.spec.uses_draft and draft is not None:
        chunk = min(w.prefill_chunk, w.spec.draft_budget)
        cap = streaming_capacity(w.spec.draft_budget, w.spec.sinks, ahead, chunk + ahead)
        out.append(Item("draft StreamingLLM cache", b * draft.layers * kv_layer_bytes(draft.kv_heads, draft.head_dim,
                                                                                       cap, draft.dtype_bytes), "both"))
    # Rotated queries of the last forward, kept per layer for rebuilds (FullCache.row_queries: each
    # row's, at most a prefill chunk per row).
    out.append(Item("stored queries", b * n * w.prefill_chunk * s.heads * d * e, "both"))
    layer_major = offloaded and w.prompt > 0  # session.Session.prefill (every row, the whole prompt)
    out += [Item("prefill hidden states", b * w.prompt * s.hidden * e if layer_major else 0, "prefill"),
            Item("prefill K/V scratch (a staging slot)", 0, "prefill"),
            Item("prefill chunk activations", _activations(s, w, b * w.prefill_chunk, w.prompt), "prefill"),
            Item("decode activations", _activations(s, w, b * (w.spec.gamma2 + 1), w.capacity), "decode"),
            Item("logits and probabilities", LOGIT_COPIES * b * (w.spec.gamma2 + 1) * s.vocab * 4, "decode")]
    if w.cuda_graphs and context and w.spec.method != "ar":
        out.append(Item("CUDA graph pools (estimate)", GRAPH_POOL_BYTES, "decode"))
    return tuple(out)


def _activations(s: Shape, w: Work, rows: int, keys: int) -> int:
    """One layer's forward of `rows` tokens against `keys` keys: hidden-size tensors (input, norm, residual,
    attention output), q/k/v, the MLP's gate, up and product, the visibility mask, and the attention
    kernel's own scratch (Work.attention)."""
    e = s.dtype_bytes
    hidden = 4 * rows * s.hidden * e
    qkv = rows * (s.heads + 2 * s.kv_heads) * s.head_dim * e
    mlp = 3 * rows * s.intermediate * e
    group = s.heads // s.kv_heads
    scratch = {"flash": 0,
               "sdpa": group * rows * keys * (e + (group > 1)),  # additive mask (+ the folded bool copy)
               "math": s.heads * rows * keys * 4}[w.attention]
    return hidden + qkv + mlp + rows * keys + scratch


def layout(shape: Shape, work: Work, resident: int, draft: Shape | None = None, context: int = CONTEXT_BYTES,
           budget: int | None = None, recompute_stats: bool = False) -> Plan:
    """The plan with `resident` layers of KV on the device, unchecked."""
    layer = work.rows * kv_layer_bytes(shape.kv_heads, shape.head_dim, work.capacity, shape.dtype_bytes)
    return Plan(shape.layers, resident, layer, items(shape, work, resident, draft, context, recompute_stats), budget,
                (shape.layers - resident) * layer,
                {"context_tokens": work.capacity, "attention": work.attention}, recompute_stats)


def plan(shape: Shape, work: Work, offload: str, budget: int | None, host_free: int, draft: Shape | None = None,
         context: int = CONTEXT_BYTES) -> Plan:
    """The plan keeping the most full-cache layers on the device whose peak fits `budget` (device bytes for
    everything, context included; None: no device, keep everything in place)."""
    if offload not in OFFLOAD_MODES:
        raise UsageError(f"--offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    n = shape.layers
    if offload == "off" or (offload == "auto" and budget is None):
        choices = [n]
    elif offload == "on":
        choices = [0]
    else:
        choices = range(n, -1, -1)
    retrieval = work.spec.middle == "retrieval"
    for r in choices:
        p = layout(shape, work, r, draft, context, budget)
        if budget is None or p.peak <= budget:
            break
        if retrieval and r:  # before offloading a layer: the resident layers' chunk statistics
            p = layout(shape, work, r, draft, context, budget, recompute_stats=True)
            if p.peak <= budget:
                break
    else:
        raise DoesNotFit(_shortage(p, budget))
    if p.host_bytes > host_free:
        raise DoesNotFit(f"not enough host memory for the offloaded KV cache: {p.host_bytes / GiB:.1f} GiB "
                          f"needed, {host_free / GiB:.1f} GiB available")
    return p


def _shortage(p: Plan, budget: int) -> str:
    phase = "prefill" if p.prefill_peak >= p.decode_peak else "decode"
    largest = sorted((i for i in p.items if i.bytes and i.phase in ("both", phase)), key=lambda i: -i.bytes)[:4]
    return (f"not enough GPU memory: {p.peak / GiB:.1f} GiB needed at the {phase} peak with "
            f"{p.resident}/{p.n_layers} layers of KV on the GPU ("
            + ", ".join(f"{i.name} {i.bytes / GiB:.1f} GiB" for i in largest)
            + f"), {budget / GiB:.1f} GiB available")
