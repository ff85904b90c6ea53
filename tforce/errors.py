"""Error types the CLI turns into one line on stderr and an exit code (2: usage, 1: runtime)."""


class TforceError(Exception):
    """A runtime failure the user can act on: one-line message, exit code 1."""

    exit_code = 1


class UsageError(TforceError):
    """Bad arguments or input: exit code 2."""

    exit_code = 2


class DoesNotFit(TforceError):
    """A memory plan refused: the work does not fit in the memory there is (exit code 1). Fewer rows of a
    batch may fit, so `run --batch` retries a refused group split smaller (cli/batch_groups.py)."""
