"""The live status on stderr beside the streamed text (text/stream.py) (the KV cache's placement from the start,
prefill progress, tokens, s/token, tokens/s, acceptance per level, tokens per verification), then a final
summary.

On a terminal that shows both the text and the status (the usual case), the status lives in the bottom rows,
outside a scroll region (DECSTBM) that the text scrolls in: the text is written as generated, the terminal
wraps it, and no status update ever erases or overwrites it. With only stderr on a terminal (stdout piped or
redirected), the status is a rich Live panel. With no terminal, there is no live view, only the summary line.
"""
from __future__ import annotations

import os
import shutil
import sys
import time

from rich.cells import cell_len

from ..engine.rates import decoded, ms_per_token, rate
from ..text.stream import TextStream


class Status:
    """What the live view shows, from generate's callbacks; fields() renders it as short phrases."""

    def __init__(self, max_new: int, method: str):
        self.max_new, self.method = max_new, method
        self.prefill = (0, 0)
        self.tokens = self.rounds = 0
        self.t_decode: float | None = None  # when prefill ended
        self.acceptance: dict = {}
        self.placement: dict | None = None  # the full KV cache's placement, planned before prefill
        self.stats: dict | None = None  # the final statistics

    def on_plan(self, placement: dict) -> None:
        self.placement = placement

    def on_prefill(self, done: int, total: int) -> None:
        self.prefill = (done, total)
        if done >= total:
            self.t_decode = time.perf_counter()

    def on_round(self, tokens: list[int], acceptance: dict) -> None:
        if self.t_decode is None:  # no report of prefill's end came: time decoding from its first round
            self.t_decode = time.perf_counter()
        if self.tokens:  # the first call brings the prefill's token (engine Session.round), not a verification's
            self.rounds += 1
        self.tokens += len(tokens)
        self.acceptance = acceptance

    def fields(self) -> list[str]:
        done, total = self.prefill
        s = self.stats
        if s is None and not self.tokens:
            return [f"prefill {done}/{total} tokens" if total else "prefill ..."] + self._kv()
        if s is None:  # as the final statistics count them: decoding's tokens are those after the prefill's first
            elapsed, n = time.perf_counter() - self.t_decode, decoded(self.tokens)
            s = {"ms_per_token": ms_per_token(n, elapsed), "tokens_per_s": rate(n, elapsed),
                 "acceptance": self.acceptance, "tokens_per_verification": n / self.rounds if self.rounds else None}
        out = [f"{self.tokens}/{self.max_new} tokens"]
        if s.get("ms_per_token") is not None:
            out.append(f"{s['ms_per_token'] / 1000:.4f} s/token")
        if s.get("tokens_per_s") is not None:
            out.append(f"{s['tokens_per_s']:.1f} tokens/s")
        out += [f"accept {level} {rate:.1%}" for level, rate in (s.get("acceptance") or {}).items() if rate is not None]
        if s.get("tokens_per_verification") is not None:
            out.append(f"{s['tokens_per_verification']:.2f} tokens/verification")
        if self.stats is not None:
            out.insert(0, f"prefill {total} tokens in {s['prefill_s']:.2f} s")
        return out + self._kv()

    def _kv(self) -> list[str]:
        """The placement field: from the final statistics, else from the plan reported at the start."""
        p = self.stats if self.stats is not None else self.placement
        if p is None:
            return []
        n = p["kv_resident_layers"] + p["kv_offloaded_layers"]
        return [f"KV cache: {p['kv_resident_layers']}/{n} layers on device, {p['kv_offloaded_layers']} in host"]


class PinnedStatus:
    """Status rows pinned to the bottom of a terminal whose upper part the streamed text scrolls in.

    The text is never touched: the status is drawn with the cursor saved and restored (DECSC/DECRC) around
    it, in rows outside the scroll region. A cursor that has just filled a row's last column waits to wrap,
    and terminals differ in whether restoring the cursor keeps that; the status is then not redrawn until
    more text has arrived."""

    def __init__(self, out, height: int):
        self.out, self.height = out, height
        self.size = _terminal_size(out)
        # Room below the cursor for the status rows: index down (scrolling at the bottom) and back up.
        self._write("\x1bD" * height + "\x1bM" * height)
        self._set_region()

    def _write(self, s: str) -> None:
        self.out.write(s)
        self.out.flush()

    def _set_region(self) -> None:
        cols, rows = self.size
        self._write(f"\x1b7\x1b[1;{max(1, rows - self.height)}r\x1b8")  # setting the region homes the cursor

    def draw(self, lines: list[str], text: str) -> bool:
        """Show lines in the status rows; False (nothing drawn) while the text's cursor waits to wrap."""
        size = _terminal_size(self.out)
        if size != self.size:  # resized: the region follows the new height
            self.size = size
            self._set_region()
        cols, rows = self.size
        tail = text.rsplit("\n", 1)[-1].rsplit("\r", 1)[-1]
        if tail and cell_len(tail) % cols == 0:
            return False
        parts = ["\x1b7"]
        for i in range(self.height):
            line = lines[i] if i < len(lines) else ""
            parts.append(f"\x1b[{rows - self.height + 1 + i};1H\x1b[2K{_crop(line, cols - 1)}")
        self._write("".join(parts) + "\x1b8")
        return True

    def close(self) -> None:
        """Clear the status rows and give the whole screen back; the cursor returns to the text's end."""
        cols, rows = _terminal_size(self.out)
        clear = "".join(f"\x1b[{rows - self.height + 1 + i};1H\x1b[2K" for i in range(self.height))
        self._write("\x1b7" + clear + "\x1b[r\x1b8")


def _terminal_size(out) -> tuple[int, int]:
    """(columns, rows) of the terminal out writes to, read again at each call so that resizes are seen."""
    try:
        size = os.get_terminal_size(out.fileno())
    except (OSError, ValueError, AttributeError):
        size = shutil.get_terminal_size()
    return size.columns, size.lines


def _crop(line: str, width: int) -> str:
    while cell_len(line) > width:
        line = line[:-1]
    return line


# The longest decode status, which sets how many rows the pinned status takes at a terminal's width.
_WIDEST = ["10000/10000 tokens", "10.0000 s/token", "1000.0 tokens/s", "accept draft 100.0%",
           "accept retrieval 100.0%", "10.00 tokens/verification", "KV cache: 80/80 layers on device, 80 in host"]


def wrap_fields(fields: list[str], width: int) -> list[str]:
    """fields joined by ' · ', a new row wherever the next field would pass width."""
    rows: list[str] = []
    for f in fields:
        if rows and cell_len(rows[-1] + " · " + f) <= width:
            rows[-1] += " · " + f
        else:
            rows.append(f)
    return rows


class Progress:
    """The live view: pinned status rows when the text shares the terminal (none on a terminal too short to
    spare them), else a rich Live panel; then a final panel."""

    REFRESH_S = 0.1

    def __init__(self, max_new: int, method: str, stream: TextStream, shared: bool):
        from rich.console import Console

        self.status = Status(max_new, method)
        self.stream = stream
        self.console = Console(stderr=True)
        self.last = 0.0
        self.pinned = self.live = None
        if shared:
            cols, rows = _terminal_size(sys.stderr)
            height = len(self._rows(_WIDEST, cols - 1))
            if rows >= height + 3:
                self.pinned = PinnedStatus(sys.stderr, height)
        else:
            from rich.live import Live

            self.live = Live(self._panel(), console=self.console, refresh_per_second=8, transient=False,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start()
        self._show(force=True)

    def on_prefill(self, done: int, total: int) -> None:
        self.status.on_prefill(done, total)
        self._show(force=done >= total)

    def on_plan(self, placement: dict) -> None:
        self.status.on_plan(placement)
        self._show(force=True)

    def on_round(self, tokens: list[int], acceptance: dict) -> None:
        first = self.status.rounds == 0
        self.status.on_round(tokens, acceptance)
        self._show(force=first)

    def finish(self, stats: dict) -> None:
        """The final statistics: a Live panel shows them and stays; pinned rows give way to a panel printed
        after the text."""
        self.status.stats = stats
        live = self.live
        if live is not None:
            live.update(self._panel(), refresh=True)
        self.close()
        if live is None:
            self.console.print(self._panel())

    def close(self) -> None:
        """End the live view, leaving the text as it is (also on errors and Ctrl-C)."""
        if self.pinned is not None:
            self.pinned.close()
        if self.live is not None:
            self.live.stop()
        self.pinned = self.live = None

    def _show(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.REFRESH_S:
            return
        if self.pinned is not None:
            drawn = self.pinned.draw(self._rows(self.status.fields(), self.pinned.size[0] - 1), self.stream.printed)
        elif self.live is not None:
            self.live.update(self._panel())
            drawn = True
        else:
            return
        if drawn:
            self.last = now

    def _rows(self, fields: list[str], width: int) -> list[str]:
        return wrap_fields([f"tforce {self.status.method}"] + fields, width)

    def _panel(self):
        from rich.panel import Panel

        rows = wrap_fields(self.status.fields(), max(20, self.console.width - 5))  # inside the border and padding
        return Panel("\n".join(rows), title=f"tforce {self.status.method}", expand=False)


def summary_line(n: int, n_prompt: int, method: str, stats: dict) -> str:
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    acc = ", ".join(f"{k} {f(v, '.1%')}" for k, v in stats["acceptance"].items() if v is not None)
    return (f"tforce: {method}: {n} tokens after {n_prompt} prompt tokens; prefill {stats['prefill_s']:.2f} s; "
            f"decode {stats['decode_s']:.2f} s ({f(stats['ms_per_token'], '.1f')} ms/token, "
            f"{f(stats['tokens_per_s'], '.1f')} tokens/s); "
            f"{f(stats['tokens_per_verification'], '.2f')} tokens/verification"
            + (f"; acceptance: {acc}" if acc else ""))
