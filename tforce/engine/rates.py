"""How a run's decoding is counted: one rule for the engine's statistics (statistics.row_stats), `bench` and the
live view (cli/live.py, which imports no torch). A row's first new token comes from its
prefill's last forward (Session.round), so decoding's tokens are each row's others, over decoding's seconds.
"""
from __future__ import annotations


def decoded(tokens: int) -> int:
    """How many of a row's `tokens` new tokens rounds made: all but the first, the prefill's."""
    return max(tokens - 1, 0)


def rate(tokens: int, seconds: float) -> float | None:
    """Tokens per second, or None when nothing was decoded or no time passed (a single run's tokens_per_s,
    a batch's batch_tokens_per_s, the live views' figures)."""
    return tokens / seconds if tokens and seconds > 0 else None


def ms_per_token(tokens: int, seconds: float) -> float | None:
    """Milliseconds of decoding per decoded token, or None when nothing was decoded."""
    return 1000 * seconds / tokens if tokens else None
