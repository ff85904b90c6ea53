"""GET /metrics: the server's counters in Prometheus' text format (version 0.0.4), for a scraper or a
dashboard: requests by status, tokens, time to first token, prefix reuse and acceptance per level."""
from __future__ import annotations

import threading
from collections import defaultdict

PREFIX = "tforce_"


class Metrics:
    """Counters updated by the server's requests (app._Line, app._refuse); rendered by `text`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict = defaultdict(int)  # HTTP status -> count
        self.sums: dict = defaultdict(float)  # name -> total
        self.acceptance: dict = defaultdict(lambda: [0.0, 0])  # level -> [sum of per-request rates, requests]

    def status(self, code: int) -> None:
        with self.lock:
            self.requests[code] += 1

    def done(self, prompt_tokens: int, completion_tokens: int, stats: dict, answered: bool = True) -> None:
        """One generation's statistics (worker's Done.stats); answered: it ends its request, which counts as
        one 200 (a request of several prompts has a generation each)."""
        with self.lock:
            self.requests[200] += answered
            s = self.sums
            s["prompt_tokens_total"] += prompt_tokens
            s["generation_tokens_total"] += completion_tokens
            s["prefix_reused_tokens_total"] += stats.get("prefix_reused") or 0
            s["prefilled_tokens_total"] += stats.get("prefilled_tokens") or 0
            s["prefill_seconds_total"] += stats.get("prefill_s") or 0.0
            s["decode_seconds_total"] += stats.get("decode_s") or 0.0
            if stats.get("ttft_s") is not None:
                s["time_to_first_token_seconds_sum"] += stats["ttft_s"]
                s["time_to_first_token_seconds_count"] += 1
            for level, rate in (stats.get("acceptance") or {}).items():
                if rate is not None:
                    self.acceptance[level][0] += rate
                    self.acceptance[level][1] += 1

    def text(self) -> str:
        with self.lock:
            lines = [f"# TYPE {PREFIX}requests_total counter"]
            lines += [f'{PREFIX}requests_total{{status="{code}"}} {n}' for code, n in sorted(self.requests.items())]
            for name in ("prompt_tokens_total", "generation_tokens_total", "prefix_reused_tokens_total",
                         "prefilled_tokens_total", "prefill_seconds_total", "decode_seconds_total"):
                lines += [f"# TYPE {PREFIX}{name} counter", f"{PREFIX}{name} {_num(self.sums[name])}"]
            lines += [f"# TYPE {PREFIX}time_to_first_token_seconds summary",
                      f"{PREFIX}time_to_first_token_seconds_sum {_num(self.sums['time_to_first_token_seconds_sum'])}",
                      f"{PREFIX}time_to_first_token_seconds_count "
                      f"{_num(self.sums['time_to_first_token_seconds_count'])}"]
            lines.append(f"# TYPE {PREFIX}acceptance_rate summary")
            for level, (total, n) in sorted(self.acceptance.items()):
                lines += [f'{PREFIX}acceptance_rate_sum{{level="{level}"}} {_num(total)}',
                          f'{PREFIX}acceptance_rate_count{{level="{level}"}} {n}']
        return "\n".join(lines) + "\n"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))
