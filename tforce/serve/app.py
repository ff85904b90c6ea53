"""The Starlette application: OpenAI's routes over a Worker, with the API key, the body-size limit,
streaming as server-sent events, disconnects that cancel, and one stderr line per request.

Every refusal is an ApiError rendered as OpenAI's error object with its status; an unexpected failure is
a 500 of the same shape and one stderr line, never a traceback to the client.
"""
from __future__ import annotations

import asyncio
import hmac
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from . import tokens
from .metrics import Metrics
from .requests import ApiError, parse
from .responses import DONE, Done, Shape, event, joined
from .jobs import Job
from .worker import Worker

POLL_S = 0.25  # how often a waiting non-streamed request looks whether its client is still there


@dataclass
class Settings:
    worker: Worker
    name: str  # the model's id in /v1/models and in responses
    api_key: Optional[str]
    max_body: int  # bytes
    log: Callable[[str], None]
    debug: bool = False  # a failure's traceback on stderr (TFORCE_DEBUG=1)
    origins: tuple = ()  # --allowed-origins: browser pages allowed to call the API (CORS)
    metrics: Metrics = field(default_factory=Metrics)


def build(settings: Settings) -> Starlette:
    card = {"id": settings.name, "object": "model", "created": 0, "owned_by": "tforce"}

    async def models(request: Request):
        _authorize(request, settings)
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request):  # openai's models.retrieve
        _authorize(request, settings)
        if request.path_params["model"] != settings.name:
            raise ApiError(404, f"the model {request.path_params['model']!r} is not served here (GET /v1/models "
                                f"lists {settings.name!r})", code="model_not_found", param="model")
        return JSONResponse(card)

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def tokenize(request: Request):
        _authorize(request, settings)
        raw = await _body(request, settings.max_body)
        return JSONResponse(await run_in_threadpool(tokens.tokenize, settings.worker, raw))

    async def detokenize(request: Request):
        _authorize(request, settings)
        raw = await _body(request, settings.max_body)
        return JSONResponse(await run_in_threadpool(tokens.detokenize, settings.worker, raw))

    async def tokenizer_info(request: Request):
        _authorize(request, settings)
        return JSONResponse(tokens.tokenizer_info(settings.worker))

    async def metrics(request: Request):
        _authorize(request, settings)
        return PlainTextResponse(settings.metrics.text(), media_type="text/plain; version=0.0.4")

    async def completions(request: Request):
        return await _generate(request, settings, chat=False)

    async def chat(request: Request):
        return await _generate(request, settings, chat=True)

    routes = [Route("/v1/models", _guard(models, settings), methods=["GET"]),
              Route("/v1/models/{model:path}", _guard(model, settings), methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/v1/health", health, methods=["GET"]),
              Route("/metrics", _guard(metrics, settings), methods=["GET"]),
              Route("/tokenize", _guard(tokenize, settings), methods=["POST"]),
              Route("/detokenize", _guard(detokenize, settings), methods=["POST"]),
              Route("/tokenizer_info", _guard(tokenizer_info, settings), methods=["GET"]),
              Route("/v1/completions", _guard(completions, settings), methods=["POST"]),
              Route("/v1/chat/completions", _guard(chat, settings), methods=["POST"])]

    async def http_error(request: Request, exc: HTTPException):  # unknown routes and methods
        return _refuse(request, settings, ApiError(exc.status_code, exc.detail or "not found",
                                                   code="not_found" if exc.status_code == 404 else None))

    middleware = []
    if settings.origins:  # a browser page of another origin (Open WebUI, a notebook) may call the API
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.origins), allow_methods=["*"],
                                     allow_headers=["*"]))
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=middleware)


def _guard(endpoint, settings: Settings):
    """endpoint, its ApiErrors and failures as OpenAI error responses (and one stderr line each)."""
    async def guarded(request: Request):
        try:
            return await endpoint(request)
        except ApiError as e:
            return _refuse(request, settings, e)
        except Exception as e:  # a bug: a 500 of OpenAI's shape, not a traceback
            if settings.debug:
                traceback.print_exc()
            first = (str(e).strip().splitlines() or [""])[0]
            return _refuse(request, settings, ApiError(500, f"{type(e).__name__}: {first}"))

    return guarded


def _refuse(request: Request, settings: Settings, e: ApiError) -> JSONResponse:
    settings.metrics.status(e.status)
    settings.log(f"tforce: serve: {request.method} {request.url.path}: {e.status} {e.message}")
    return JSONResponse(e.body(), status_code=e.status)


def _authorize(request: Request, settings: Settings) -> None:
    if settings.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key")


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"the request body is larger than the server's limit ({limit} bytes, --max-body)",
                         code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _generate(request: Request, settings: Settings, chat: bool):
    _authorize(request, settings)
    ask = parse(await _body(request, settings.max_body), chat)
    if ask.model is not None and ask.model != settings.name:
        raise ApiError(404, f"the model {ask.model!r} is not served here (GET /v1/models lists {settings.name!r})",
                       code="model_not_found", param="model")
    jobs = await run_in_threadpool(settings.worker.prepare, ask)  # tokenizing a long document takes a while
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in jobs]  # each job's events

    def poster(events: asyncio.Queue):
        def post(item):  # from the worker's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody is listening
                pass
        return post

    try:
        for job, events in zip(jobs, queues):  # queued together: they run one after another, in order
            job.post = poster(events)
            settings.worker.submit(job)
    except ApiError:  # the server is stopping: those queued already are not waited for
        for job in jobs:
            job.cancel()
        raise
    shape = Shape(chat, settings.name)
    lines = [_Line(request, settings, job) for job in jobs]
    if ask.stream:
        return StreamingResponse(_stream(jobs, queues, shape, ask.include_usage, lines),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    results = []
    try:
        for i, (events, line) in enumerate(zip(queues, lines)):
            item = await _next(events, request)
            if item is None:
                line.say("the client went away; cancelled")
                return JSONResponse({}, status_code=499)
            if item[0] != "done":
                raise _failure(item)
            _, text, done = item
            line.done(done, answered=i == len(jobs) - 1)
            results.append((text, done))
    finally:
        for job in jobs:
            job.cancel()  # a no-op once it is done; else its client went away, or an earlier prompt failed
    return JSONResponse(shape.whole(results))


async def _next(events: asyncio.Queue, request: Request):
    """The job's next item that is not streamed text (its end), or None when the client disconnects first."""
    get = asyncio.ensure_future(events.get())
    while True:
        done, _ = await asyncio.wait({get}, timeout=POLL_S)
        if not done:
            if await request.is_disconnected():
                get.cancel()
                return None
            continue
        item = get.result()
        if item[0] not in ("text", "logprobs"):  # what a stream sends as it comes
            return item
        get = asyncio.ensure_future(events.get())


async def _stream(jobs: list, queues: list, shape: Shape, include_usage: bool, lines: list):
    """The jobs' chunks, one choice after another (they run in order), each with its index."""
    ended, dones = False, []
    try:
        for index, (events, line) in enumerate(zip(queues, lines)):
            first = True
            parts: list = []  # log-probabilities of tokens whose text is to come (part of a character, a stop string)
            while True:
                item = await events.get()
                if item[0] == "logprobs":
                    parts.append(item[1])
                elif item[0] == "text":
                    yield shape.chunk(item[1], first, joined(parts), index)
                    first, parts = False, []
                elif item[0] == "done":
                    yield shape.last(item[2], first, joined(parts), index)
                    line.done(item[2], answered=index == len(jobs) - 1)
                    dones.append(item[2])
                    break
                else:
                    error = _failure(item)
                    yield event(error.body())
                    line.say(f"{error.status} {error.message}")
                    yield DONE
                    ended = True
                    return
        if include_usage:
            yield shape.usage(dones)
        yield DONE
        ended = True
    finally:
        for job in jobs:  # a no-op for those done; else the client went away, or an earlier prompt failed
            job.cancel()
        if not ended:  # the client went away (the response's task was cancelled): so is its generation
            lines[min(len(dones), len(lines) - 1)].say("the client went away; cancelled")


def _failure(item) -> ApiError:
    if item[0] == "error":
        return item[1]
    return ApiError(503, "the server is stopping", code="shutting_down")  # ("cancelled",) while stopping


class _Line:
    """A request's one stderr line."""

    def __init__(self, request: Request, settings: Settings, job: Job):
        self.what = f"{request.method} {request.url.path}"
        self.log, self.t0, self.prompt = settings.log, time.perf_counter(), len(job.ids)
        self.metrics = settings.metrics

    def say(self, how: str) -> None:
        self.log(f"tforce: serve: {self.what}: {how} ({self.prompt} prompt tokens, {time.perf_counter() - self.t0:.2f} s)")

    def done(self, done: Done, answered: bool = True) -> None:
        """answered: the request's last generation (Metrics.done)."""
        s = done.stats
        self.metrics.done(done.prompt_tokens, done.completion_tokens, s, answered)
        acc = ", ".join(f"{k} {v:.1%}" for k, v in s["acceptance"].items() if v is not None)
        per_token = "n/a" if s["ms_per_token"] is None else f"{s['ms_per_token'] / 1000:.4f}"
        self.log(f"tforce: serve: {self.what}: {done.completion_tokens} tokens after {done.prompt_tokens} prompt "
                 f"tokens ({s['prefix_reused']} reused, {s['prefilled_tokens']} prefilled in {s['prefill_s']:.2f} s); "
                 f"{per_token} s/token" + (f"; acceptance: {acc}" if acc else "")
                 + f"; finish {done.finish_reason}")
