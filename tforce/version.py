"""tforce's version (pyproject.toml's; a test checks they agree), importable without torch."""
__version__ = "0.1.0"
