"""Status rows pinned to the bottom of a terminal whose upper part streamed text scrolls in (a DECSTBM
scroll region): the live view of `tforce run` and `tforce chat` when the text shares the terminal (live.py)."""
from __future__ import annotations

import os
import shutil

from rich.cells import cell_len


class PinnedStatus:
    """Status rows pinned to the bottom of a terminal whose upper part the streamed text scrolls in.

    The text is never touched: the status is drawn with the cursor saved and restored (DECSC/DECRC) around
    it, in rows outside the scroll region. A cursor that has just filled a row's last column waits to wrap,
    and terminals differ in whether restoring the cursor keeps that; the status is then not redrawn until
    more text has arrived."""

    def __init__(self, out, height: int):
        self.out, self.height = out, height
        self.size = terminal_size(out)
        # Room below the cursor for the status rows: index down (scrolling at the bottom) and back up.
        self._write("\x1bD" * height + "\x1bM" * height)
        self._set_region()

    def _write(self, s: str) -> None:
        self.out.write(s)
        self.out.flush()

    def _set_region(self) -> None:
        cols, rows = self.size
        self._write(f"\x1b7\x1b[1;{max(1, rows - self.height)}r\x1b8")  # setting the region homes the cursor

    def draw(self, lines: list[str], text: str) -> bool:
        """Show lines in the status rows; False (nothing drawn) while the text's cursor waits to wrap."""
        size = terminal_size(self.out)
        if size != self.size:  # resized: the region follows the new height
            self.size = size
            self._set_region()
        cols, rows = self.size
        tail = text.rsplit("\n", 1)[-1].rsplit("\r", 1)[-1]
        if tail and cell_len(tail) % cols == 0:
            return False
        parts = ["\x1b7"]
        for i in range(self.height):
            line = lines[i] if i < len(lines) else ""
            parts.append(f"\x1b[{rows - self.height + 1 + i};1H\x1b[2K{crop(line, cols - 1)}")
        self._write("".join(parts) + "\x1b8")
        return True

    def close(self) -> None:
        """Clear the status rows and give the whole screen back; the cursor returns to the text's end."""
        cols, rows = terminal_size(self.out)
        clear = "".join(f"\x1b[{rows - self.height + 1 + i};1H\x1b[2K" for i in range(self.height))
        self._write("\x1b7" + clear + "\x1b[r\x1b8")


def terminal_size(out) -> tuple[int, int]:
    """(columns, rows) of the terminal out writes to, read again at each call so that resizes are seen."""
    try:
        size = os.get_terminal_size(out.fileno())
    except (OSError, ValueError, AttributeError):
        size = shutil.get_terminal_size()
    return size.columns, size.lines


def crop(line: str, width: int) -> str:
    while cell_len(line) > width:
        line = line[:-1]
    return line
