from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Lossless hierarchical speculative decoding (TriForce) for long-context Llama models.")
