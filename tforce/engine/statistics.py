"""Each row's statistics after a decode (acceptance per level, tokens per verification, rates, the memory
plan's placement), for one prompt, a batch's rows and a conversation turn; decode.py runs the loop."""
from __future__ import annotations

from . import placement
from .rates import decoded, ms_per_token, rate


def acceptance(session, r: int = 0) -> dict:
    """Prompt r's acceptance so far per level: {"draft", "retrieval"} (None where the method has none)."""
    def acc(level):
        return None if level is None else level.stats.acceptance(r)

    return {"draft": acc(session.verifies_draft), "retrieval": acc(session.verifies_middle)}


def level_counts(session) -> dict:
    """Every prompt's drafted tokens so far per level, as (accepted, drafted): {"draft", "retrieval"} (None
    where the method has none); counts, not rates, so that several batches' add up."""
    def counts(level):
        return None if level is None else (sum(level.stats.accepted), sum(level.stats.drafted))

    return {"draft": counts(session.verifies_draft), "retrieval": counts(session.verifies_middle)}


def placement_stats(plan: placement.Plan) -> dict:
    """The full cache's placement, as the statistics and on_plan report it."""
    return {
        "kv_resident_layers": plan.resident,
        "kv_offloaded_layers": plan.offloaded,
        "kv_device_bytes": plan.gpu_bytes,  # on the model's device: the GPU, or host memory on a CPU run
        "kv_host_bytes": plan.host_bytes,
        "kv_chunk_stats_recomputed": plan.recompute_stats,  # no room to keep the resident layers' (placement.py)
    }


def planned_peak(plan: placement.Plan) -> dict:
    """The plan's predicted device peak (prefill or decode, the larger; everything, weights included) and its
    CUDA context share (measured on CUDA, 0 on a CPU run): bench sets the allocator's peaks beside them."""
    return {"plan_peak_bytes": plan.peak, "plan_context_bytes": plan.item("CUDA context")}


def row_stats(session, r: int, outs: list[list[int]], prefill_s: float, decode_s: float,
              before: dict[str, tuple[int, float, int]]) -> dict:
    """Prompt r's statistics: the session's prefill_s and decode_s, ms_per_token (decode_s over the tokens
    every row decoded after its first, which the prefill gave: as peers measure it, bench/peers.py),
    forwards and stage_s per node while decoding (before: session.counts() when decoding began), the
    placement and the plan's peak, retrieval rebuild seconds (the prefill's, then those while decoding,
    every row's); the row's own verifications (rounds that decided its tokens), tokens_per_verification,
    acceptance and rebuilds while decoding."""
    now = session.counts()
    n_all = sum(decoded(len(out)) for out in outs)  # tokens decode_s made
    n_out, verified = decoded(len(outs[r])), session.verified[r]  # the row's, from verifications
    retrieval = session.retrieval is not None
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "ms_per_token": ms_per_token(n_all, decode_s),
        "batch_tokens_per_s": rate(n_all, decode_s),  # every row's; one row's is its tokens_per_s (one_row)
        "acceptance": acceptance(session, r),
        "tokens_per_verification": n_out / verified if verified else None,
        "verifications": verified,
        # per node while decoding: what each level's step costs is read that often
        "forwards": {name: c[0] - before[name][0] for name, c in now.items()},
        # and the rows they fed (a forward of R rows counts R; one row: the forwards)
        "row_forwards": {name: c[2] - before[name][2] for name, c in now.items()},
        # per node, seconds of those forwards (timing.py); the rest of decode_s is sampling, verification,
        # host syncs, rebuilds and Python between forwards
        "stage_s": {name: c[1] - before[name][1] for name, c in now.items()},
        **placement_stats(session.plan),
        **planned_peak(session.plan),
        # Retrieval rebuilds: the prefill's (within prefill_s), then those while decoding (within decode_s;
        # rows rebuilt together share one); rebuilds counts the row's. None without a retrieval cache.
        "prefill_rebuild_s": session.rebuild_times[0] if session.rebuild_times else None,
        "rebuild_s": sum(session.rebuild_times[1:]) if retrieval else None,
        "rebuilds": session.rebuilds[r] if retrieval else None,
    }


def one_row_stats(session, out: list[int], prefill_s: float, decode_s: float, before: dict) -> dict:
    """A one-row session's statistics (Conversation.ask, serve): row_stats under one_row's names."""
    return one_row(row_stats(session, 0, [out], prefill_s, decode_s, before))


def one_row(stats: dict) -> dict:
    """A one-row run's statistics under `generate`'s names: the batch's tokens/s (the tokens after the first
    over decode_s, as ms_per_token) is the row's tokens_per_s, and there is no batch size."""
    stats.pop("batch_size", None)
    stats["tokens_per_s"] = stats.pop("batch_tokens_per_s")
    return stats

