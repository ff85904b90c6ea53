"""How `tforce run --batch` splits a file whose batch does not fit: consecutive groups of prompts, each planned
for its own rows, and a group the engine refuses retried split smaller.

The CLI's check (common.check_memory, `tforce info`'s plan) runs before any weights load, so that a file
with a prompt that fits nowhere is refused at once; the engine plans each group again when it runs it
(placement.py, with the memory measured then), and where the two disagree (on CUDA: another process took
memory, the context grew) the engine's refusal (errors.DoesNotFit) halves the group instead of ending the run.
"""
from __future__ import annotations

from typing import Callable, Iterator

from ..errors import DoesNotFit
from .common import say


def plan_groups(check: Callable[[range], None], n: int) -> list[range]:
    """Consecutive groups of the n prompts, in the file's order, each the most prompts from its start that
    check(prompts) lets through (it raises DoesNotFit when they do not fit). check plans the prompts as the
    engine plans a batch, each row of their longest row's capacity, so short prompts make larger groups
    than a group holding a long one. A prompt that does not fit even alone is refused with check's message
    for it."""
    groups, start = [], 0
    while start < n:
        size = _most_that_fit(lambda k: check(range(start, start + k)), n - start)
        groups.append(range(start, start + size))
        start += size
    return groups


def _most_that_fit(check: Callable[[int], None], n: int) -> int:
    """The most rows k, up to n, that check(k) lets through; the plan grows with k, so bisect. Raises
    check(1)'s refusal when not even one fits."""
    try:
        check(n)
        return n
    except DoesNotFit:
        if n == 1:
            raise
    check(1)
    fits, over = 1, n
    while over - fits > 1:
        mid = (fits + over) // 2
        try:
            check(mid)
            fits = mid
        except DoesNotFit:
            over = mid
    return fits


def run_groups(groups: list[range], run: Callable[[range, int], list]) -> Iterator[list]:
    """The results of each group run, in the file's order; run(prompts, g) runs one group, g counting
    the groups run before it (its seed). A group the engine refuses (DoesNotFit) is run as its two halves
    instead, each split again if refused, with one stderr note each time; a single prompt's refusal is
    raised (one error line, as for any run that does not fit)."""
    pending, g = list(groups), 0
    while pending:
        rows = pending.pop(0)
        try:
            results = run(rows, g)
        except DoesNotFit as e:
            if len(rows) == 1:
                raise
            half = rows.start + len(rows) // 2
            pending[:0] = [range(rows.start, half), range(half, rows.stop)]
            say(f"tforce: prompts {rows.start + 1}-{rows.stop} do not fit together after all ({e}): running them "
                 f"as batches of {half - rows.start} and {rows.stop - half}")
            continue
        g += 1
        yield results
