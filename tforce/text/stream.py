"""Generated tokens as text, written as they are accepted: the command line's stdout and the server's
streamed responses."""
from __future__ import annotations


class TextStream:
    """Decodes the whole generated id list after each accepted batch and writes only the new suffix."""

    def __init__(self, tokenizer, out, enabled: bool = True, stops=None):
        """stops: stops.StopStrings, whose text is not written (nor what follows it)."""
        self.tokenizer, self.out, self.enabled, self.stops = tokenizer, out, enabled, stops
        self.ids: list[int] = []
        self.printed = ""

    def text(self, final: bool = True) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self.stops.shown(text, final) if self.stops else text

    def add(self, tokens: list[int]) -> None:
        self.ids += list(tokens)
        if self.enabled:
            text = self.text(final=False)
            self._emit(text[:-1] if text.endswith("\ufffd") else text)  # hold back a partial character

    def finish(self) -> str:
        text = self.text()
        if self.enabled:
            self._emit(text)
        return text

    def _emit(self, text: str) -> None:
        # If decoding revised earlier text (rare), what is written cannot be unwritten: go on past it.
        new = text[len(self.printed):]
        if new:
            self.out.write(new)
            self.out.flush()
            self.printed = text
