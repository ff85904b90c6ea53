"""The live status on stderr of `tforce run` (one prompt, its text streamed beside it), `tforce run --batch`
(many) and `tforce chat`, and the final summary: one view for N rows, one prompt being one row.

It shows the KV cache's placement from the start and the prefill's progress in prompt tokens, then tokens
(of their budget), tokens/s (each row's tokens after its first, which the prefill gives: engine/rates.py),
acceptance per level and, for one row, s/token and tokens per verification, for several the rows done;
counted across the consecutive batches a file that does not fit runs as (batch_groups.py).

Where it shows: when the text shares a terminal with the status (one prompt, stdout and stderr the same
terminal), in the bottom rows, outside the scroll region the text scrolls in (pinned.py): the text is written
as generated and no update ever erases it. Otherwise, with stderr a terminal, a rich Live panel redrawn by
rich's refresh thread (the decode loop only updates counts; notes written to stderr meanwhile go above it).
With no terminal there is no live view, only the summary line.
"""
from __future__ import annotations

import os
import sys
import time

from ..engine.rates import decoded, ms_per_token, rate
from .pinned import PinnedStatus, terminal_size


class Status:
    """What the live view shows, from the engine's Events (events.py) for rows of these prompt lengths with
    these token budgets, one batch (group of rows) after another; fields() renders it as short phrases. Read
    by rich's refresh thread while the decode loop updates it: each shared value is read once."""

    def __init__(self, prompt_lengths: list[int], budgets: list[int], method: str):
        self.method, self.rows, self.budget = method, len(prompt_lengths), sum(budgets)
        self.need = list(prompt_lengths)  # a prefill feeds each prompt whole (its last forward: the first token)
        self.prefill_total, self.prefilled = sum(self.need), 0  # prefilled: the finished batches' tokens
        self.rows_done = self.tokens = 0
        self.decoded = 0  # the finished batches' decoding tokens
        self.decode_s = 0.0  # the finished batches' decoding time
        self.counts: dict = {}  # the finished batches' (accepted, drafted) per level
        self.placement: dict | None = None  # the full KV cache's placement, planned before prefill
        self.final: dict | None = None  # the run's statistics once it is done
        self.start(range(self.rows))  # one batch of every row, unless the caller starts others

    def start(self, rows: range) -> None:
        """A batch of these rows starts (again, after the engine refused it whole)."""
        self.group, self.group_prefilled = sum(self.need[r] for r in rows), 0
        self.t_decode, self.group_counts, self.rounds = None, {}, 0
        self.group_rows: dict[int, int] = {}  # tokens per row of this batch so far

    def end(self) -> None:
        """The batch started last finished: its figures join the whole run's."""
        self.prefilled += self.group
        self.decoded += self._group_decoded()
        if self.t_decode is not None:
            self.decode_s += time.perf_counter() - self.t_decode
        self.counts = self._counts()
        self.start(range(0))

    def on_plan(self, placement: dict) -> None:
        self.placement = placement

    def on_prefill(self, done: int, total: int) -> None:
        """done of total (tokens or token-layers of the batch's rows), scaled to the batch's tokens."""
        self.group_prefilled = self.group * done // total if total else self.group
        if done >= total and self.t_decode is None:
            self.t_decode = time.perf_counter()

    def on_round(self, tokens: dict, counts: dict) -> None:
        """Events.on_round: {row: its new tokens}, each level's (accepted, drafted) so far."""
        if self.t_decode is None:  # no prefill to report (one-token prompts): decoding starts here
            self.t_decode = time.perf_counter()
        if self.group_rows:  # the first round brings the prefill's tokens (Session.round), not a verification's
            self.rounds += 1
        for r, t in tokens.items():
            self.tokens += len(t)
            self.group_rows[r] = self.group_rows.get(r, 0) + len(t)
        self.group_counts = counts

    def on_row(self) -> None:
        self.rows_done += 1

    def _group_decoded(self) -> int:
        return sum(decoded(n) for n in list(self.group_rows.values()))

    def _counts(self) -> dict:
        out = dict(self.counts)
        for level, c in self.group_counts.items():
            if c is not None:
                a, d = out.get(level) or (0, 0)
                out[level] = (a + c[0], d + c[1])
        return out

    def fields(self) -> list[str]:
        final, t_decode, one = self.final, self.t_decode, self.rows == 1
        prefilled = self.prefilled + self.group_prefilled
        out = []
        if final is None and t_decode is None and prefilled < self.prefill_total:
            out.append(f"prefill {prefilled}/{self.prefill_total} tokens" if self.prefill_total else "prefill ...")
        if final is not None and one:
            out.append(f"prefill {self.prefill_total} tokens in {final['prefill_s']:.2f} s")
        if not one:
            out.append(f"rows {self.rows_done}/{self.rows} done")
        if self.tokens:
            out.append(f"{self.tokens}/{self.budget} tokens" if self.budget else f"{self.tokens} tokens")
            if final is not None:
                ms = final.get("ms_per_token")
                per_s = final.get("tokens_per_s") if one else final.get("batch_tokens_per_s")
            else:
                elapsed = self.decode_s + (time.perf_counter() - t_decode if t_decode is not None else 0)
                n = self.decoded + self._group_decoded()
                ms, per_s = ms_per_token(n, elapsed), rate(n, elapsed)
            if one and ms is not None:
                out.append(f"{ms / 1000:.4f} s/token")
            if per_s is not None:
                out.append(f"{per_s:.1f} tokens/s")
        out += [f"accept {level} {a / d:.1%}" for level, (a, d) in self._counts().items() if d]
        if one and self.tokens:
            per_round = final.get("tokens_per_verification") if final is not None else \
                (decoded(self.tokens) / self.rounds if self.rounds else None)
            if per_round is not None:
                out.append(f"{per_round:.2f} tokens/verification")
        return out + self._kv()

    def _kv(self) -> list[str]:
        """The placement field: from the final statistics, else from the plan reported at the start."""
        p = self.final if self.final is not None and "kv_resident_layers" in self.final else self.placement
        if p is None:
            return []
        n = p["kv_resident_layers"] + p["kv_offloaded_layers"]
        return [f"KV cache: {p['kv_resident_layers']}/{n} layers on device, {p['kv_offloaded_layers']} in host"]


# The longest decode status, which sets how many rows the pinned status takes at a terminal's width.
_WIDEST = ["10000/10000 tokens", "10.0000 s/token", "1000.0 tokens/s", "accept draft 100.0%",
           "accept retrieval 100.0%", "10.00 tokens/verification", "KV cache: 80/80 layers on device, 80 in host"]


def wrap_fields(fields: list[str], width: int) -> list[str]:
    """fields joined by ' · ', a new row wherever the next field would pass width."""
    from rich.cells import cell_len

    rows: list[str] = []
    for f in fields:
        if rows and cell_len(rows[-1] + " · " + f) <= width:
            rows[-1] += " · " + f
        else:
            rows.append(f)
    return rows


class Progress:
    """The live view of a Status (module docstring): pinned rows under the text `stream` when `shared`
    (none on a terminal too short to spare them), else a rich Live panel; then a final panel. Its on_*
    methods are the Events' callbacks."""

    REFRESH_S = 0.1  # the pinned rows' redraws, made from the decode loop

    def __init__(self, status: Status, title: str, stream=None, shared: bool = False):
        from rich.console import Console

        self.status, self.title, self.stream = status, title, stream
        self.console = Console(stderr=True)
        self.last = 0.0
        self.pinned = self.live = None
        if shared:
            cols, rows = terminal_size(sys.stderr)
            height = len(self._rows(_WIDEST, cols - 1))
            if rows >= height + 3:
                self.pinned = PinnedStatus(sys.stderr, height)
                self._show(force=True)
        else:
            from rich.live import Live

            self.live = Live(self, console=self.console, refresh_per_second=8, transient=False,
                             redirect_stdout=False, redirect_stderr=True)
            self.live.start(refresh=True)

    def on_plan(self, placement: dict) -> None:
        self.status.on_plan(placement)
        self._show(force=True)

    def on_prefill(self, done: int, total: int) -> None:
        self.status.on_prefill(done, total)
        self._show(force=done >= total)

    def on_round(self, tokens: dict, counts: dict) -> None:
        first = self.status.rounds == 0
        self.status.on_round(tokens, counts)
        self._show(force=first)

    def finish(self, stats: dict) -> None:
        """The final statistics: a Live panel shows them and stays; pinned rows give way to a panel printed
        after the text."""
        self.status.final = stats
        live = self.live
        if live is not None:
            live.refresh()
        self.close()
        if live is None:
            self.console.print(self.__rich__())

    def close(self) -> None:
        """End the live view, leaving the text as it is (also on errors and Ctrl-C)."""
        if self.pinned is not None:
            self.pinned.close()
        if self.live is not None:
            self.live.stop()
        self.pinned = self.live = None

    def _show(self, force: bool = False) -> None:
        """Redraw the pinned rows (a Live panel redraws itself)."""
        now = time.perf_counter()
        if self.pinned is None or (not force and now - self.last < self.REFRESH_S):
            return
        if self.pinned.draw(self._rows(self.status.fields(), self.pinned.size[0] - 1), self.stream.printed):
            self.last = now

    def _rows(self, fields: list[str], width: int) -> list[str]:
        return wrap_fields([self.title] + fields, width)

    def __rich__(self):
        from rich.panel import Panel

        rows = wrap_fields(self.status.fields(), max(20, self.console.width - 5))  # inside the border and padding
        return Panel("\n".join(rows), title=self.title, expand=False)


def shared_with_stderr() -> bool:
    """stdout and stderr write to the same file or pipe (`2>&1`): end the text's line before the
    summary, as on a terminal. A file or pipe of its own gets the text exactly as generated."""
    try:
        a, b = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # captured streams without a descriptor
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def text_progress(stream, prompt_len: int, max_new: int, method: str, as_json: bool) -> Progress | None:
    """The live view of one prompt whose text `stream` writes to stdout (`run`, a chat's answer): with stderr
    on a terminal and no --json; pinned under the text where both share the terminal."""
    if not sys.stderr.isatty() or as_json:
        return None
    return Progress(Status([prompt_len], [max_new], method), f"tforce {method}", stream,
                    shared=sys.stdout.isatty() and shared_with_stderr())


def summary_line(n: int, n_prompt: int, method: str, stats: dict) -> str:
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    acc = ", ".join(f"{k} {f(v, '.1%')}" for k, v in stats["acceptance"].items() if v is not None)
    return (f"tforce: {method}: {n} tokens after {n_prompt} prompt tokens; prefill {stats['prefill_s']:.2f} s; "
            f"decode {stats['decode_s']:.2f} s ({f(stats['ms_per_token'], '.1f')} ms/token, "
            f"{f(stats['tokens_per_s'], '.1f')} tokens/s); "
            f"{f(stats['tokens_per_verification'], '.2f')} tokens/verification"
            + (f"; acceptance: {acc}" if acc else ""))
