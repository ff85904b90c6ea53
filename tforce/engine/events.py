"""What a generation tells its caller while it runs: one set of callbacks for one prompt and for a batch
(one prompt is row 0), each optional."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Events:
    # the full KV cache's placement (statistics.placement_stats: the kv_* entries), once planned, before prefill
    on_plan: Callable[[dict], None] | None = None
    # prefill progress: (done, total) tokens of all rows (token-layers where the prefill runs layer-major)
    on_prefill: Callable[[int, int], None] | None = None
    # after each round, for each row that took part: (row, its new tokens, its acceptance so far per level
    # {"draft", "retrieval"}); the tokens are final (an exact prefix of the answer)
    on_tokens: Callable[[int, list, dict], None] | None = None
    # after each round: ({row: its new tokens}, each level's (accepted, drafted) tokens so far over the rows:
    # statistics.level_counts)
    on_round: Callable[[dict, dict], None] | None = None
    # once a row is finished (EOS, a stop string, its budget): (row, all its tokens)
    on_row: Callable[[int, list], None] | None = None
    # before each round: the command line's thread governor (threads.tick) follows the machine's load here
    on_step: Callable[[], None] | None = None
    # after each round, asked per row with every token it generated so far: how many to keep and end there
    # (stops.StopStrings.cut), or None to go on; what is kept stays an exact prefix
    until: Callable[[list], int | None] | None = None
