"""The models and the one Session every request shares, generating one request at a time on a thread of
its own (the device does one generation at a time; requests wait in a queue, in arrival order).

Prefix reuse: the session's caches keep what the last request left. A new prompt is fed to them as a
conversation's question is (session.Session.prefill): each node rolls back to the longest prefix it holds
that the prompt shares and is fed only the rest, so a second question about the same document prefills
only its own tokens. The small draft's streaming cache (sinks and a recent window) cannot roll back far;
when a prompt branches off what the caches hold (a new question after the same document), its state is
marked at the branch point (session.Session.mark), so that later prompts sharing that prefix restore it
instead of feeding the draft the whole prefix again. With a KVStore (--kv-dir), a prompt that shares
more with a snapshot on disk than with the live caches starts from that snapshot. The output is what
the same prompt gives alone: at temperature 0 `tforce run`'s greedy tokens, with a seed its draw
(tests/serve/test_serve_exact.py).

With --max-batch N above 1, requests that can run as rows of a batch do (batch.py: continuous batching,
a second Session of N rows); the others, and all of them with N = 1, run here one at a time.

A client that disconnects cancels its job: checked between decoding rounds and after each prefill chunk
of the full cache, where every cache has committed what it was fed (the next prompt rolls each back to
what it shares); the caches keep what they hold. The server stopping ends a running answer at its next
round and refuses a prompt still in its prefill.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import queue
import threading
import traceback
import time
from typing import Callable, Optional

import torch

from .. import threads
from ..text.stream import TextStream
from ..config import RunConfig, Sampling
from ..engine.driver import drive
from ..engine.events import Events
from ..engine.generate import check_config, eos_ids, check_ids, generator, open_session
from ..engine.session import Session
from ..engine.prompt_logprobs import prompt_logprobs
from ..errors import TforceError, UsageError
from ..text.format import PromptFormat
from ..engine.stops import StopStrings
from .kv_store import KVStore, shared_prefix
from .requests import ApiError, Ask
from .batch import Batch, batchable
from .jobs import Cancelled, Job, TextEvents
from .responses import Done, LogprobParts, entries, token_logprobs


class Worker:
    def __init__(self, target, draft, tokenizer, name: str, context: int, config: RunConfig, template: str = "auto",
                 system: Optional[str] = None, stops: tuple = (), log: Callable = print, debug: bool = False,
                 store: Optional[KVStore] = None, max_batch: int = 1):
        """target, draft: loaded networks (draft None for methods without one); context: tokens the shared
        session holds (prompt and answer); config: the server's defaults (max_new_tokens, ignore_eos, the
        sampling) and the speculation and execution settings every request runs with. debug: a
        failure's traceback on stderr (TFORCE_DEBUG=1). store: prompts' KV snapshots on disk (--kv-dir).
        max_batch: rows of the batch session (batch.py); 1: none."""
        self.max_new = config.max_new_tokens
        self.eos = set() if config.ignore_eos else eos_ids(target.config)
        self.defaults = config.sampling
        self.target, self.tok, self.name, self.context = target, tokenizer, name, context
        # Requests are tokenized on the server's threads while this one decodes: a fast tokenizer that one
        # thread encodes with (which sets its truncation state) and another decodes with at once fails
        # ("Already borrowed"), so the server's side has a copy of its own, one request at a time.
        self.encoder, self.encoding = copy.deepcopy(tokenizer), threading.Lock()
        self.template, self.system, self.stops, self.log, self.debug = template, system, stops, log, debug
        self.store = store
        self.session = open_session(target, draft, context - 1, 1, config)
        self.marked: Optional[torch.Tensor] = None  # the prefix the streaming caches' states are marked at
        self.batch = None
        if max_batch > 1:  # rows that change between rounds: no CUDA graph holds their shapes
            run = dataclasses.replace(config, execution=dataclasses.replace(config.execution, cuda_graphs=False))
            session = Session(target, draft, context - 1, 1, check_config(target, draft, run), rows=max_batch)
            session.keep([])  # every row free
            self.batch = Batch(session, tokenizer, self.eos, session.spec.method)
        self.jobs: queue.Queue = queue.Queue()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="tforce-worker", daemon=True)
        self.thread.start()

    # -------------------------------------------------------------------------- on the server's side

    def prepare(self, ask: Ask) -> list:
        """The request's Jobs, one per prompt (chat: one, its messages in the chat template), each checked
        against the context; ApiError."""
        d = self.defaults
        sampling = Sampling(d.temperature if ask.temperature is None else ask.temperature,
                            d.top_p if ask.top_p is None else ask.top_p, d.top_k if ask.top_k is None else ask.top_k,
                            d.seed if ask.seed is None else ask.seed)
        _usage(sampling.validate)
        wanted = self.max_new if ask.max_tokens is None else ask.max_tokens
        jobs = []
        for prompt in ask.prompts or (None,):
            with self.encoding:
                ids = self._encode(ask, prompt)
                # token ids echo as their text (special tokens left out, as a prompt's text has none)
                echo = (prompt if isinstance(prompt, str) else self.encoder.decode(ids, skip_special_tokens=True)
                        ) if ask.echo else None
            what = "the prompt" if len(ask.prompts) < 2 else f"prompt[{len(jobs)}]"
            if not ids:
                raise ApiError(400, f"{what} is empty once tokenized", param="messages" if ask.chat else "prompt")
            if len(ids) >= self.context:
                raise ApiError(400, f"{what} is {len(ids)} tokens; the server's context is {self.context}",
                               code="context_length_exceeded", param="messages" if ask.chat else "prompt")
            _usage(check_ids, self.target, ids)
            jobs.append(Job(ids, min(wanted, self.context - len(ids)), sampling, ask.stop or self.stops, ask.chat,
                            ask.logprobs, echo))
        return jobs

    def _encode(self, ask: Ask, prompt) -> list:
        """prompt: one of a completion's prompts (text, or token ids), None for chat."""
        if isinstance(prompt, tuple):
            return list(prompt)  # checked against the vocabulary by check_ids
        if not ask.chat:
            return list(self.encoder.encode(prompt))
        fmt = _usage(PromptFormat, self.encoder, self.template, self.system, self.name)
        if not fmt.templated:
            raise ApiError(400, f"{self.name} has no chat template (or the server runs with --template none): "
                                "send the text to /v1/completions", code="no_chat_template", param="messages")
        return _usage(fmt.messages_ids, list(ask.messages))

    def text_ids(self, text: str, special: bool = True) -> list:
        """/tokenize: the text's ids, the tokenizer's special tokens first unless special is False."""
        with self.encoding:
            return list(self.encoder(text, add_special_tokens=special).input_ids)

    def chat_ids(self, messages: tuple) -> list:
        """/tokenize with messages: the ids /v1/chat/completions would prefill."""
        with self.encoding:
            return self._encode(Ask(chat=True, model=None, messages=messages), None)

    def text_of(self, ids: list) -> str:
        """/detokenize; an id outside the vocabulary is a 400."""
        _usage(check_ids, self.target, ids)
        with self.encoding:
            return self.encoder.decode(ids)

    def submit(self, job: Job) -> None:
        if self.stopping:
            raise ApiError(503, "the server is stopping", code="shutting_down")
        self.jobs.put(job)

    def stop(self) -> None:
        """Stop taking jobs: those waiting are refused (503), the running one ends at its next round (its
        answer so far, finish_reason "length"), or, still in its prefill, is refused."""
        self.stopping = True
        self.jobs.put(None)

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    # ----------------------------------------------------------------------- on the worker's thread

    def _loop(self) -> None:
        waiting: collections.deque = collections.deque()  # taken from the queue, not batched yet: first
        while True:
            batch = self.batch
            if batch is not None and batch.live:
                self._admit(batch, waiting)
                if self.stopping:
                    batch.stop()
                    continue
                try:
                    threads.tick()
                    batch.step()
                except Exception as e:  # a bug or a device failure: every row's request gets it
                    batch.fail(self._failure(e))
                continue
            job = waiting.popleft() if waiting else self.jobs.get()
            if job is None:
                break
            if job.cancelled.is_set():  # its client went away while it waited
                continue
            if batch is not None and batchable(job):
                self._join(batch, job)
            else:
                self._attempt(job, lambda: self._run(job), self._reset)
        for job in list(waiting) + [self.jobs.get() for _ in range(self.jobs.qsize())]:
            if job is not None:  # refused: the server stopped before their turn
                job.post(("error", ApiError(503, "the server is stopping", code="shutting_down")))

    def _admit(self, batch: Batch, waiting: collections.deque) -> None:
        """Between rounds: the queued requests join the batch while they can, in arrival order; the first
        that cannot (it runs alone, samples otherwise, or no row is free) waits, and so do all after it."""
        while not waiting:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.cancelled.is_set():
                continue
            if job is None or self.stopping or not (batchable(job) and batch.takes(job)):
                waiting.append(job)
                return
            self._join(batch, job)

    def _join(self, batch: Batch, job: Job) -> None:
        """The job joins the batch (its prompt prefilled in a free row), or is refused; a failure mid-prefill
        (the batch's rows may be half-written) fails the running rows too."""
        self._attempt(job, lambda: batch.join(job, time.perf_counter()), batch.fail)

    def _attempt(self, job: Job, work: Callable, reset: Callable) -> None:
        """work() for the job, or its refusal posted: 503 while stopping, its own ApiError, a usage error as a
        400; a bug or a device failure as a 500, after reset(that error) puts the caches right."""
        try:
            if self.stopping:
                raise ApiError(503, "the server is stopping", code="shutting_down")
            work()
        except Cancelled:
            job.post(("cancelled",))
        except ApiError as e:
            job.post(("error", e))
        except UsageError as e:  # refused before any work
            job.post(("error", ApiError(400, str(e))))
        except Exception as e:
            error = self._failure(e)
            reset(error)
            job.post(("error", error))

    def _reset(self, error: ApiError) -> None:
        """After a failure in the one-row session: its caches may be half-written, so they start afresh."""
        self.session.rewind(0)
        self.marked = None

    def _failure(self, e: Exception) -> ApiError:
        """A bug or a device failure as the 500 its request gets (the traceback on stderr with --debug)."""
        if self.debug:
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        what = "" if isinstance(e, TforceError) else f"{type(e).__name__}: "
        return ApiError(500, what + first)

    def _run(self, job: Job) -> None:
        s = self.session
        t0 = time.perf_counter()

        def check(*_):  # prefill progress: a prompt not yet answered is dropped when the server stops
            job.check()
            if self.stopping:
                raise Cancelled()

        s.resample(job.sampling)
        s.record_logprobs(job.logprobs is not None)
        try:
            self._generate(job, check, t0)
        finally:
            s.record_logprobs(False)

    def _generate(self, job: Job, check: Callable, t0: float) -> None:
        """_run's work once the session draws from the job's sampling (and records log-probabilities if asked)."""
        s = self.session
        prompt = torch.tensor(job.ids)
        loaded = self.store.restore(s, prompt, self._held(prompt)) if self.store is not None else None
        if loaded is not None:
            self.marked = None  # the streaming caches hold the snapshot's states now
        reused = self._reuse(prompt, check)
        s.reset_stats()
        stops = StopStrings(self.tok, job.stops)
        parts = None if job.logprobs is None else LogprobParts(self.tok, job.logprobs, job.chat)
        said = TextEvents(job.post, self.tok, parts)
        stream = TextStream(self.tok, said, stops=stops or None)
        picked: list = []  # responses.entries of each token (the echoed prompt's, the answer's), with job.logprobs
        if job.echo is not None:  # the prompt first (a stream's first chunk), with its log-probabilities
            if job.logprobs is not None:  # from a forward of the target over the prompt (prompt_logprobs.py)
                picked = prompt_logprobs(self.target, job.ids, job.logprobs, s.full.cache.rotary,
                                         s.full.prefill_chunk, check)
            said.echo(job.echo, picked)

        def on_tokens(r, tokens, acceptance):
            job.check()
            if job.logprobs is not None:  # the rows of the forwards that decided these tokens (Session.logprobs)
                new = entries(zip(tokens, s.logprobs[0][:len(tokens)]), job.logprobs)
                picked.extend(new)
                said.tokens(tokens, new)
            stream.add(tokens)

        def until(tokens):  # a stop string, or the server stopping: the answer so far ends cleanly
            return len(tokens) if self.stopping else stops.cut(tokens) if stops else None

        def save() -> None:  # a prompt that prefilled enough to be worth a snapshot (--kv-dir)
            if self.store is not None and len(job.ids) - reused >= self.store.min_tokens:
                self.store.save(s)

        events = Events(on_prefill=check, on_tokens=on_tokens, until=until, on_step=threads.tick)
        [out], [stats] = drive(s, [prompt], [job.max_new], generator(self.target, job.sampling.seed), self.eos, events,
                               t0, save)
        text = stream.finish()
        said.finish()
        stopped = bool(out) and (out[-1] in self.eos or stops.matched(out) is not None)
        extension = {"prefix_reused": reused, "prefix_from_kv_dir": loaded or 0,
                     "prefilled_tokens": len(job.ids) - reused, "ttft_s": stats["ttft_s"],
                     "prefill_s": stats["prefill_s"], "decode_s": stats["decode_s"],
                     "ms_per_token": stats["ms_per_token"], "acceptance": stats["acceptance"],
                     "tokens_per_verification": stats["tokens_per_verification"],
                     "method": s.spec.method, **({"server_stopped": True} if self.stopping else {})}
        logprobs = None if job.logprobs is None else token_logprobs(self.tok, picked, job.logprobs, job.chat)
        done = Done("stop" if stopped else "length", len(job.ids), len(out), extension, logprobs)
        job.post(("done", text if job.echo is None else job.echo + text, done))

    def _held(self, prompt: torch.Tensor) -> int:
        """How many of the prompt's tokens, but its last (the prefill feeds it again for the first token), the
        full cache holds."""
        full = self.session.full
        return shared_prefix(full.tokens[0, :full.cache.length], prompt[:-1])

    def _reuse(self, prompt: torch.Tensor, check: Callable) -> int:
        """How many of the prompt's tokens (but its last, which the prefill feeds for the first token) the caches hold
        already. When the prompt branches off what they hold below the streaming caches' reach, they are
        prefilled to the branch point and marked there first (unless marked at or beyond it already)."""
        s = self.session
        held, shared = s.full.cache.length, self._held(prompt)
        marked = self.marked
        usable = marked is not None and len(marked) <= len(prompt) and torch.equal(marked, prompt[:len(marked)])
        if shared < held and shared > 0 and s.streaming_nodes() and not (usable and len(marked) >= shared):
            s.prefill([prompt], check, upto=[shared])
            s.mark()
            self.marked = prompt[:shared].clone()
        return shared


def _usage(fn, *args):
    """fn(*args), a tforce usage error as a 400."""
    try:
        return fn(*args)
    except UsageError as e:
        raise ApiError(400, str(e)) from None
