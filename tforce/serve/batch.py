"""Continuous batching for `tforce serve --max-batch N`: requests that arrive while others are answered join
the running batch between rounds, as rows of one Session of N rows (engine/joining.py), and leave it when
done, so a queued request waits for a round, not for the others' whole answers.

Which requests join (the rest run alone on the worker's one-row session, in arrival order, once the batch
has drained; worker.py): those without log-probabilities or echo (the session records log-probabilities
for one row). A request joins a running batch only if it samples the same way (temperature, top-p, top-k:
every level of the hierarchy draws with the session's one setting), and none joins while a request that
cannot is waiting (first come, first served).

Each answer is what the request gives alone: greedy, its tokens (float32 on the CPU; tests/serve/
test_serve_batch.py); sampled with a seed, its tokens too (the row draws from its own generator:
sampling.RowGenerators); sampled without one, the same distribution (tests/engine/test_joining.py). A joining prompt's
longest prefix that a running row holds (a document several clients ask about) is copied, not prefilled
(Session.admit); a finished row's KV is not kept for later requests (the one-row session keeps its own).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..engine.generate import generator
from ..engine.joining import Joining
from ..engine.stops import StopStrings
from ..text.stream import TextStream
from .jobs import Job, TextEvents
from .responses import Done


def batchable(job: Job) -> bool:
    """Whether a request may run as a row of the batch (the module docstring)."""
    return job.logprobs is None and job.echo is None


def drawing(job: Job):
    """The request's sampling as the batch's rows share it (each row's seed is its own generator's)."""
    return replace(job.sampling, seed=None)


@dataclass
class Answer:
    """A joined request's stream and times."""
    job: Job
    stream: TextStream
    said: TextEvents
    stops: StopStrings
    t0: float  # when the worker took it
    t1: float  # its prefill done, its first token drawn


class Batch:
    def __init__(self, session, tok, eos: set[int], method: str):
        """session: the worker's batch Session (rows: --max-batch), every row free."""
        self.session, self.tok, self.method = session, tok, method
        self.joining = Joining(session, generator(session.target, None), eos)
        self.answers: dict[int, Answer] = {}  # by the joined row's index r
        self.sampling = None  # the running rows' (drawing()), None when none runs

    @property
    def live(self) -> int:
        return len(self.answers)

    def takes(self, job: Job) -> bool:
        """Whether the job can join now: a free row, and the running rows' sampling (or none running)."""
        return self.joining.free > 0 and (self.sampling is None or drawing(job) == self.sampling)

    def join(self, job: Job, t0: float) -> None:
        """Prefill the job's prompt into a free row and post its first text (its answer, if that ends it)."""
        if self.sampling is None:
            self.sampling = drawing(job)
            self.session.resample(self.sampling)
        job.check()
        stops = StopStrings(self.tok, job.stops)
        said = TextEvents(job.post, self.tok)
        answer = Answer(job, TextStream(self.tok, said, stops=stops or None), said, stops, t0, 0.0)
        seed = job.sampling.seed
        own = None if seed is None or job.sampling.greedy else generator(self.session.target, seed)
        r, first, done = self.joining.join(job.ids, job.max_new, stops.cut if stops else None, own)
        answer.t1 = time.perf_counter()
        self.answers[r] = answer
        answer.stream.add(first)
        if done:
            self._finish(r, self.joining.done.pop(r))

    def step(self) -> None:
        """One round of every row: their new text posted, finished ones answered; a row whose client went
        away leaves."""
        for r, answer in list(self.answers.items()):
            if answer.job.cancelled.is_set():
                self.joining.drop(r)
                self.answers.pop(r)
                answer.job.post(("cancelled",))
        for r, (tokens, done) in self.joining.step().items():
            self.answers[r].stream.add(tokens)
            if done:
                self._finish(r, self.joining.done.pop(r))
        if not self.answers:
            self.sampling = None

    def stop(self) -> None:
        """The server stops: every running answer ends now, with what it has (finish_reason "length")."""
        for r in list(self.answers):
            self._finish(r, self.joining.drop(r), stopped=True)
        self.sampling = None

    def fail(self, error) -> None:
        """A failure in a round: every running request gets it; the rows are freed."""
        for r, answer in list(self.answers.items()):
            self.joining.drop(r)
            answer.job.post(("error", error))
        self.answers.clear()
        self.joining.rows.clear()
        self.joining.done.clear()
        self.session.keep([])
        self.sampling = None

    def _finish(self, r: int, row, stopped: bool = False) -> None:
        """row: the finished joining.Row (its tokens and statistics)."""
        answer = self.answers.pop(r)
        out, stats = row.out, row.stats
        text = answer.stream.finish()
        answer.said.finish()
        now = time.perf_counter()
        eos_or_stop = bool(out) and (out[-1] in self.joining.eos or answer.stops.matched(out) is not None)
        decoded = max(len(out) - 1, 0)
        verifications = stats.get("verifications")
        extension = {"prefix_reused": row.reused, "prefix_from_kv_dir": 0,
                     "prefilled_tokens": len(answer.job.ids) - row.reused,
                     "ttft_s": answer.t1 - answer.t0, "prefill_s": answer.t1 - answer.t0,
                     "decode_s": now - answer.t1,
                     "ms_per_token": 1000 * (now - answer.t1) / decoded if decoded else None,
                     "acceptance": stats.get("acceptance"),
                     "tokens_per_verification": decoded / verifications if verifications else None,
                     "method": self.method, "batched": True, **({"server_stopped": True} if stopped else {})}
        done = Done("stop" if eos_or_stop and not stopped else "length", len(answer.job.ids), len(out), extension,
                    None)
        answer.job.post(("done", text, done))
