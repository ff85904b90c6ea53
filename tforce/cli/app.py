from __future__ import annotations

import typer

# rich_markup_mode=None: Click's plain help layout. Typer's rich panels label every option with its
# Python type, `<bool>` on --help and on flags declared without common.flag among them.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Lossless hierarchical speculative decoding (TriForce) for long-context Llama models.")


def _version(value: bool) -> None:
    if value:
        from ..version import __version__

        print(f"tforce {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print tforce's version and exit.",
                                       is_eager=True, callback=_version)) -> None:
    """Lossless hierarchical speculative decoding (TriForce) for long-context Llama models."""
