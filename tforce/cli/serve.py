"""`tforce serve`: the model pair behind an OpenAI-compatible HTTP API (tforce/serve/, docs/serve.md).

The options are run's (model, method, sampling defaults, budgets, placement, template); the server's own
are where it listens, its API key, the largest request body and the context its one KV cache holds.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import typer

from ..config import Sampling
from ..errors import TforceError, UsageError
from . import options as o
from .app import app
from .common import check_memory, debug_on, guarded, say
from .setup import configure, read_draft_config, dtype_bytes, notices


@app.command()
@o.shared(snapshots=False,
          max_new_tokens=typer.Option(o.MAX_NEW_TOKENS.default, "--max-new-tokens", "-n",
                                      help="max_tokens when a request gives none."),
          temperature=typer.Option(Sampling.temperature, "--temperature", "-t",
                                   help="temperature when a request gives none."),
          top_p=typer.Option(Sampling.top_p, "--top-p", help="top_p when a request gives none."),
          seed=typer.Option(None, "--seed", help="seed when a request gives none (default: random)."),
          template=typer.Option("auto", "--template", help="auto: chat requests are laid out in the model's chat "
                                 "template | none: refuse chat requests (completions take text as it is)."))
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: one the system picks)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="TFORCE_API_KEY",
                                          help="Refuse requests without 'Authorization: Bearer KEY' (401)."),
    max_body: int = typer.Option(16 * 2**20, "--max-body", help="Largest request body in bytes (413 above)."),
    ctx_size: Optional[int] = typer.Option(None, "--ctx-size", help="Tokens the server's KV cache holds, prompt "
                                           "and answer (default: the model's context)."),
    name: Optional[str] = typer.Option(None, "--served-model-name", "--name",
                                       help="The model's id in the API (default: --model's short name or hub id as "
                                            "given, a file's or folder's name, or the demo target's folder name)."),
    kv_dir: Optional[str] = typer.Option(None, "--kv-dir", metavar="DIR", help="Keep long prompts' KV caches there "
                                         "as snapshots, reused across restarts."),
    kv_dir_size: str = typer.Option("16GiB", "--kv-dir-size", help="Most bytes --kv-dir holds (least recently "
                                    "used snapshots removed first)."),
    kv_dir_min: int = typer.Option(1024, "--kv-dir-min", help="Prompt tokens a request must prefill to be kept "
                                   "in --kv-dir."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", metavar="FILE",
                                                help="A Jinja chat template for chat requests: a base model's, or "
                                                     "one to use instead of the model's own."),
    max_batch: int = typer.Option(1, "--max-batch", metavar="N", help="Requests answered together as rows of one "
                                  "batch, joining it as they arrive (continuous batching; 1: one at a time)."),
    allowed_origins: Optional[str] = typer.Option(None, "--allowed-origins",
                                                  help="Origins whose browser pages may call the API (CORS), "
                                                       "comma-separated, or '*'."),
    opts: Optional[dict] = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    params = {**opts, **{k: v for k, v in locals().items() if k != "opts"}}

    def body():
        missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
        if missing:
            raise TforceError(f"tforce serve needs {' and '.join(missing)}: pip install 'tforce[serve]'")
        if not 0 <= port <= 65535:
            raise UsageError(f"--port must be in [0, 65535], got {port}")
        if max_body < 1:
            raise UsageError(f"--max-body must be >= 1, got {max_body}")
        if api_key is not None and not api_key.strip():
            raise UsageError("--api-key must not be empty")
        web = {"chat_template": _read_template(chat_template, opts["template"]),
               "origins": tuple(x.strip() for x in (allowed_origins or "").split(",") if x.strip())}
        setup = configure(params, calibrate=False)
        if setup.world > 1:
            raise UsageError("tforce serve runs in one process: --tp and --gpus are not supported yet")
        from ..bench.suite import parse_size

        store = None if kv_dir is None else (kv_dir, parse_size(kv_dir_size, "--kv-dir-size"), kv_dir_min)
        if kv_dir_min < 1:
            raise UsageError(f"--kv-dir-min must be >= 1, got {kv_dir_min}")
        if max_batch < 1:
            raise UsageError(f"--max-batch must be >= 1, got {max_batch}")
        if max_batch > 1 and setup.config.execution.deterministic:
            raise UsageError("--max-batch above 1 and --deterministic are not supported together yet")
        web["max_batch"] = max_batch
        _serve(setup, host, port, api_key, max_body, ctx_size, name or _served_name(opts["model"], setup.target), store,
               web)

    guarded(body)


def _read_template(file: Optional[str], template: str) -> Optional[str]:
    """--chat-template's text, checked as Jinja before anything is loaded; None without the option."""
    if file is None:
        return None
    if template == "none":
        raise UsageError("--chat-template and --template none contradict each other")
    try:
        text = Path(file).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --chat-template {file}: {getattr(e, 'strerror', None) or e}") from e
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment().parse(text)
    except TemplateSyntaxError as e:
        raise UsageError(f"--chat-template {file}: line {e.lineno}: {e.message}") from e
    return text


def _served_name(model: Optional[str], target: str) -> str:
    """The id clients name the model by: a short name or hub id as given, a local file's or folder's own
    name (not the path typed, which a client cannot know), else the target folder's name."""
    if model is None:
        return Path(target).name
    return Path(model).expanduser().name if Path(model).expanduser().exists() else model


def _serve(setup, host: str, port: int, api_key: Optional[str], max_body: int, ctx_size: Optional[int],
           name: str, store: Optional[tuple], web: dict) -> None:
    """store: (--kv-dir, its size limit in bytes, --kv-dir-min) or None; web: the chat template's text (or
    None) and the CORS origins."""
    from ..serve.app import Settings, build
    from ..serve.server import listen, run
    from ..serve.worker import Worker

    path, config, tok = setup.target_files()  # one process: `serve` takes no --tp
    if web["chat_template"] is not None:
        tok.chat_template = web["chat_template"]
    context = config.max_position_embeddings
    if ctx_size is not None and not 2 <= ctx_size <= context:
        raise UsageError(f"--ctx-size must be in [2, {context}] (the model's context), got {ctx_size}")
    context = ctx_size or context
    fmt = setup.prompt_format(tok, path)
    notices(setup, fmt, serving=True)
    draft_config = read_draft_config(setup.draft, config, tok) if setup.draft else None
    check_memory(config, draft_config, context, dtype_bytes(setup.dtype, setup.device), setup.device, setup.config,
                 rows=1 + (web["max_batch"] if web["max_batch"] > 1 else 0))  # the one-row session and the batch's
    target, small = setup.load()
    try:
        sock = listen(host, port)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    if store is not None:
        from ..serve.kv_store import KVStore
        from ..snapshot.identity import identity

        store = KVStore(*store, identity(target, small), log=say)
    worker = Worker(target.model, small.model if small else None, tok, name, context, setup.config, setup.template,
                    setup.system, setup.stops, log=say, debug=debug_on(), store=store, max_batch=web["max_batch"])
    if api_key is None and not _loopback(host):
        say(f"tforce: note: listening on {host} without --api-key: whoever reaches the port can use the model")
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    batched = f", batches of up to {web['max_batch']}" if web["max_batch"] > 1 else ""
    say(f"tforce: serving {name} ({setup.config.method}, {context}-token context{batched}) on http://{shown}:{bound}/v1"
         + (" (API key required)" if api_key else ""))
    try:
        run(build(Settings(worker, name, api_key, max_body, say, debug_on(), origins=web["origins"])), sock, worker.stop)
    finally:
        worker.stop()
        worker.join(5)
        sock.close()
    say("tforce: serve: stopped")


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
