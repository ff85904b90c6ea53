"""The live view on stderr (prefill progress, tokens, s/token, acceptance) and the streamed text on stdout."""
from __future__ import annotations

import time

class TextStream:
    """Decodes the whole generated id list after each accepted batch and writes only the new suffix."""

    def __init__(self, tokenizer, out, enabled: bool = True):
        self.tokenizer, self.out, self.enabled = tokenizer, out, enabled
        self.ids: list[int] = []
        self.printed = ""

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> None:
        self.ids += list(tokens)
        if self.enabled:
            text = self.text()
            self._emit(text[:-1] if text.endswith("\ufffd") else text)  # hold back a partial character

    def finish(self) -> str:
        text = self.text()
        if self.enabled:
            self._emit(text)
        return text

    def _emit(self, text: str) -> None:
        # If decoding revised earlier text (rare), what is written cannot be unwritten: go on past it.
        new = text[len(self.printed):]
        if new:
            self.out.write(new)
            self.out.flush()
            self.printed = text


class Progress:
    """A rich Live panel on stderr (terminals only): prefill progress, tokens, speed, acceptance."""

    def __init__(self, max_new: int, method: str, keep_live: bool):
        from rich.console import Console
        from rich.live import Live

        self.console = Console(stderr=True)
        self.max_new, self.method, self.keep_live = max_new, method, keep_live
        self.prefill = (0, 0)
        self.tokens = self.rounds = 0
        self.t_decode: float | None = None
        self.stats: dict | None = None
        self.live = Live(self._panel(), console=self.console, refresh_per_second=8, transient=not keep_live,
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def on_prefill(self, done: int, total: int) -> None:
        self.prefill = (done, total)
        self._update()

    def on_token(self, tokens: list[int]) -> None:
        if self.t_decode is None:
            self.t_decode = time.perf_counter()
            if not self.keep_live:  # stdout is this terminal too: let the text stream undisturbed
                self.live.stop()
        self.tokens += len(tokens)
        self.rounds += 1
        self._update()

    def finish(self, stats: dict) -> None:
        self.stats = stats
        if self.keep_live:
            self.live.update(self._panel(), refresh=True)
            self.live.stop()
        else:  # the live panel was transient: print the final one
            self.live.stop()
            self.console.print(self._panel())

    def _update(self) -> None:
        if self.live.is_started:
            self.live.update(self._panel())

    def _panel(self):
        from rich.panel import Panel
        from rich.table import Table

        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        done, total = self.prefill
        t.add_row("prefill", f"{done}/{total} tokens" if total else "...")
        t.add_row("generated", f"{self.tokens}/{self.max_new} tokens")
        s = self.stats
        if s is None and self.t_decode is not None and self.tokens:
            elapsed = time.perf_counter() - self.t_decode
            s = {"ms_per_token": 1000 * elapsed / self.tokens, "tokens_per_s": self.tokens / elapsed if elapsed else None,
                 "acceptance": {}, "tokens_per_verification": None}
        if s is not None:
            if s.get("ms_per_token") is not None:
                t.add_row("speed", f"{s['ms_per_token'] / 1000:.4f} s/token, {s['tokens_per_s']:.1f} tokens/s")
            for level, rate in (s.get("acceptance") or {}).items():
                if rate is not None:
                    t.add_row(f"accept {level}", f"{rate:.1%}")
            tpv = s.get("tokens_per_verification")
            if tpv is None and self.rounds:
                tpv = self.tokens / self.rounds
            if tpv is not None:
                t.add_row("tokens/verify", f"{tpv:.2f}")
        return Panel(t, title=f"tforce {self.method}", expand=False)


def _summary_line(n: int, n_prompt: int, method: str, stats: dict) -> str:
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    acc = ", ".join(f"{k} {f(v, '.1%')}" for k, v in stats["acceptance"].items() if v is not None)
    return (f"tforce: {method}: {n} tokens after {n_prompt} prompt tokens; prefill {stats['prefill_s']:.2f} s; "
            f"decode {stats['decode_s']:.2f} s ({f(stats['ms_per_token'], '.1f')} ms/token, "
            f"{f(stats['tokens_per_s'], '.1f')} tokens/s); "
            f"{f(stats['tokens_per_verification'], '.2f')} tokens/verification"
            + (f"; acceptance: {acc}" if acc else ""))
