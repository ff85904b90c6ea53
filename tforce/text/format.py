"""How text becomes the target's prompt tokens: raw, or in the model's chat template.

An instruction-tuned model (Llama-3.1-8B-Instruct, LWM-Text-Chat) answers well only when the prompt is
laid out as it was trained: role headers, turn ends, the assistant's header last. Its tokenizer carries
that layout as a Jinja chat template, which transformers renders (`apply_chat_template`); a base model's
tokenizer has none and gets the text as it is.

- `run` (and each `--batch` line): the document and the question, joined by a blank line, are one user
  message. Raw: `tokenizer.encode(text)` (its BOS added). Templated: the rendered conversation, ending
  in the assistant's header, tokenized whole without adding special tokens (the template writes them).
- `chat`: the document is prefilled once, each question appended to its tokens. So the template is cut
  into pieces that do not depend on the question: it is rendered around marker strings standing for the
  questions and the answer, and split at them. The document's piece ends with the blank line after the
  document's text (and starts without its leading whitespace when the template strips a message's): the
  text before a question is then tokenized as `run` tokenizes it, where a Llama 3 tokenizer makes one
  token of punctuation and the newlines after it ("wisdom.\n\nWho?": ".\n\n"); the blank line is
  tokenized as it comes before a letter, where a GPT-2-style pre-tokenizer (the demo pair's) splits it in
  two ("\n", "\n") that it keeps one token at a text's end. A question's piece is
  the question and what closes the user's turn (through the assistant's header), tokenized as it comes
  after the blank line. With --keep-history a later question's piece starts with what follows an
  assistant's answer in the template (its turn end, then the next user header); when the answer already
  ended with the special token the template writes there, that token is not written twice.
  Raw: the document and the blank line after it with BOS, then the question without special tokens; a
  later question after an answer is "\\n\\n" + question. A snapshot's document made before the blank line
  joined the document's piece (it does not end with one) gets it in the first question's piece instead.
- A template that writes the date is rendered on the date a KV snapshot's tokens hold when one is reused
  (`as_made`; text/dates.py), else on today's.
"""
from __future__ import annotations

from datetime import datetime

from ..errors import UsageError
from .dates import date_in, pieces, rendered_by, written

TEMPLATES = ("auto", "none")
SEPARATOR = "\n\n"  # between the document (or the previous answer) and a question
# Stand-ins for text that is not known when the template is cut: no template writes these.
_ANCHOR = "a"  # what a piece is tokenized after (_encode_after)
_Q1, _ANSWER, _Q2 = "\x00tforce-question-1\x00", "\x00tforce-answer\x00", "\x00tforce-question-2\x00"
_CUT = f"D{SEPARATOR}{_Q1}"  # where the document's head ends in a rendering


class PromptFormat:
    def __init__(self, tokenizer, template: str = "auto", system: str | None = None, name: str = "the model",
                 now: datetime | None = None):
        """template: auto (the tokenizer's chat template when it has one) or none (the text as it is).
        system: a system message, which needs a template. name: the model, for messages. now: the time a
        template that writes the date renders (default: now, fixed for this format's life)."""
        if template not in TEMPLATES:
            raise UsageError(f"--template must be one of {', '.join(TEMPLATES)}, got {template!r}")
        self.tok, self.name = tokenizer, name
        self.templated = template == "auto" and bool(getattr(tokenizer, "chat_template", None))
        if system is not None and not self.templated:
            why = "--template none" if template == "none" else f"{name}'s tokenizer has no chat template"
            raise UsageError(f"--system needs a chat template ({why})")
        self.system = system
        self.now = now or datetime.now()
        self.snapshot_date: str | None = None  # as_made's: the date taken from a snapshot, as the template writes it
        if self.templated:
            self._cut()

    # ------------------------------------------------------------------------------------------ run

    def prompt_ids(self, text: str) -> list[int]:
        """The tokens of one prompt (document and question already joined)."""
        if not self.templated:
            return list(self.tok.encode(text))
        return self._encode(self._render([{"role": "user", "content": text}]))

    def messages_ids(self, messages: list[dict]) -> list[int]:
        """The tokens of a whole conversation ({"role", "content"} messages, as an OpenAI-style chat request
        gives it) in the chat template, ending in the assistant's header; one user message is prompt_ids'
        layout of its text. Needs a template (`templated`)."""
        if not self.templated:
            raise UsageError(f"{self.name} has no chat template to lay messages out in")
        return self._encode(self._render(list(messages)))

    # ----------------------------------------------------------------------------------------- chat

    def document_ids(self, document: str) -> list[int]:
        """The document and the blank line a first question follows."""
        if not self.templated:
            return self._encode_before(document + SEPARATOR, lambda text: list(self.tok.encode(text)))
        return self._encode_before(self._head + (document.lstrip() if self._lstrip else document) + SEPARATOR,
                                   self._encode)

    def ends_with_separator(self, ids: list[int]) -> bool:
        """Whether a document's tokens end with the blank line (document_ids'; a KV snapshot made by an
        earlier tforce does not)."""
        return self.tok.decode(list(ids)[-8:], skip_special_tokens=False).endswith(SEPARATOR)

    def check_document(self, ids: list[int], source: str) -> None:
        """Refuse a document's tokens (a KV snapshot's prefix, from `source`) that were not laid out in
        this format's template: questions in the template after a raw document (or the reverse) are a
        prompt the model was not trained on. The head's last token is not compared: it may merge with the
        document's first characters. Refused too: a whole prompt's tokens (`tforce run --save-kv` keeps all
        but the last), whose user turn already closes with the assistant's header: a question after it
        would be written inside the answer."""
        ids = list(ids)
        if not self.templated:
            if any(ids[:len(opening)] == opening for opening in self._openings()):
                raise UsageError(f"{source} begins with {self.name}'s chat template (made without --template "
                                 "none?): give the same --template and --system as when it was made")
            return
        head = self._head_ids()
        if ids[:len(head)] != head:
            day = ", or on another day (the template writes the date)" if len(pieces(self._head_with)) > 1 else ""
            raise UsageError(f"{source} does not begin with {self.name}'s chat template (made with --template none "
                             f"or another --system{day}?): give the same --template and --system as when it was made")
        close = self._encode_after(self._close)
        if ids[len(ids) - len(close):] == close or (len(close) > 1 and ids[len(ids) - len(close) + 1:] == close[:-1]):
            raise UsageError(f"{source} holds a whole prompt, its user turn closed for an answer (made by tforce "
                             "run?): chat needs a document's snapshot (tforce chat BOOK --save-kv DIR)")

    def as_made(self, ids: list[int]) -> "PromptFormat":
        """This format as it laid out a KV snapshot's tokens `ids`: rendered on the date they hold when the
        template writes the date and they hold another than this format's (with `snapshot_date` set); else
        itself."""
        if not self.templated:
            return self
        head = self._head_ids()
        if list(ids[:len(head)]) == head:
            return self
        text = self.tok.decode(list(ids[:len(head) + 64]), skip_special_tokens=False)
        when = date_in(self._head_with, text)
        if when is None:
            return self
        made = PromptFormat(self.tok, "auto", self.system, self.name, now=when)
        made.snapshot_date = written(self._head_with, when)
        return made

    def question_ids(self, question: str, answer: list[int] | None = None, separated: bool = True) -> list[int]:
        """The tokens of a question after the document (answer None; `separated`: the document's tokens end
        with the blank line, as document_ids' do) or after an answer's tokens as the conversation's history
        holds them (--keep-history; Conversation leaves end-of-sequence tokens out)."""
        close = self._close if self.templated else ""
        if answer is None:
            return self._encode_after(question + close, SEPARATOR) if separated else \
                self._encode_after(SEPARATOR + question + close)
        if not self.templated:
            return self._encode_after(SEPARATOR + question)
        self.check_history()
        return self._encode_after(self._after(answer) + question + self._close_later)

    def check_history(self) -> None:
        """Refuse --keep-history when the template does not lay a conversation out by appending turns: one
        that moves its system message to the last user turn (Mistral-7B-Instruct-v0.3 with --system) writes
        the first turn differently once a second follows, so the document's prefilled turn would not be the
        template's."""
        if self.templated and not self._appends:
            given = " with --system" if self.system is not None else ""
            raise UsageError(f"--keep-history: {self.name}'s chat template{given} lays out a conversation's "
                             "earlier turns differently once another follows, so a conversation cannot grow after "
                             "the prefilled document; ask without --keep-history")

    # ------------------------------------------------------------------------------------- internals

    def _messages(self, content: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return system + [{"role": "user", "content": content}]

    def _render(self, messages: list[dict], strftime=None) -> str:
        """The conversation rendered, its date (if the template writes one) by `strftime` (default: this
        format's `now`), which stands for transformers' `strftime_now` in the template."""
        if self.system is not None and messages[0]["role"] != "system":
            messages = self._messages(messages[0]["content"]) + messages[1:]
        try:
            with rendered_by(strftime or self.now.strftime):
                return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may refuse a layout (e.g. no system role): its message, one line
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"{self.name}'s chat template refused the prompt ({reason}); "
                             "--template none gives the text as it is") from e

    def _after(self, answer: list[int]) -> str:
        """What the template writes between an answer and the next question, less the special token the
        answer ended with when the template writes that token there (after its own spacing, as Llama 2's
        ' </s>'): the model has already closed its turn, and a second end token is not what it was trained on."""
        between = self._between
        if answer and answer[-1] in set(getattr(self.tok, "all_special_ids", ())):
            end = self.tok.convert_ids_to_tokens(answer[-1])
            rest = between.lstrip()
            if end and rest.startswith(end):
                return rest[len(end):]
        return between

    def _openings(self) -> list[list[int]]:
        """How a document laid out in this tokenizer's chat template begins (without a system message; with
        one, up to its text; up to the date where the template writes one), where that is more than raw
        text's start (its BOS): what check_document looks for under --template none. Nothing without a
        template, or where it cannot place a document."""
        if not getattr(self.tok, "chat_template", None):
            return []
        try:
            heads = [self._encode(PromptFormat(self.tok)._undated_head())]
        except UsageError:
            return []
        try:  # the text two system messages share
            s, t = (PromptFormat(self.tok, system=text)._undated_head() for text in ("S", "T"))
            heads.append(self._encode(s[:next((i for i, (a, b) in enumerate(zip(s, t)) if a != b), len(s))]))
        except UsageError:  # a template that takes no system message
            pass
        start = len(self.tok.encode(""))
        return [head[:-1] for head in heads if len(head) - 1 > start]  # the last token may merge with the text

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _encode_before(self, text: str, encode) -> list[int]:
        """The tokens of text that a question follows, as they come when the whole is tokenized: with a
        letter after it, then without the letter's token. A GPT-2-style pre-tokenizer (the demo pair's)
        makes one token of a blank line at the end of a text but two newline tokens before a word, and
        the document's tokens must be a prefix of run's. Where the letter merges with the text before it,
        the text is tokenized alone."""
        ids = encode(text + _ANCHOR)
        if len(ids) > 1 and self.tok.decode(ids[-1:]) == _ANCHOR and \
                self.tok.decode(ids[-9:-1], skip_special_tokens=False).endswith(SEPARATOR):
            return ids[:-1]
        return encode(text)

    def _encode_after(self, piece: str, before: str = _ANCHOR) -> list[int]:
        """The tokens of text that follows other text, as they come when the whole is tokenized: after
        `before` (the blank line that ends a document's piece, or a letter), then without its tokens.
        Tokenized alone, a piece gets what starts a text (a SentencePiece tokenizer writes a space before
        "\n\nWho?"), which `run` does not give the same document and question. A letter does not merge
        with the newlines or special tokens that start a piece after an answer, nor newlines with the
        letters of a question; where the boundary still differs, the piece is tokenized alone."""
        anchor = self._encode(before)
        ids = self._encode(before + piece)
        return ids[len(anchor):] if ids[:len(anchor)] == anchor else self._encode(piece)

    def _head_with(self, strftime) -> str:
        """The document's head (what comes before its text), its date rendered by `strftime`."""
        one = self._render([{"role": "user", "content": _CUT}], strftime)
        return one[:one.index(_CUT)]

    def _head_ids(self) -> list[int]:
        """The head's tokens but its last, which may merge with a document's first characters."""
        return self._encode(self._head)[:-1]

    def _undated_head(self) -> str:
        """The document's head up to the date its template writes (a snapshot's may hold another day's)."""
        return pieces(self._head_with)[0]

    def _cut(self) -> None:
        """The template's pieces around the document and the questions (see the module's docstring)."""
        one = self._render([{"role": "user", "content": _CUT}])
        two = self._render([{"role": "user", "content": _CUT},
                            {"role": "assistant", "content": _ANSWER}, {"role": "user", "content": _Q2}])
        if one.count(_CUT) != 1 or two.count(_ANSWER) != 1 or two.count(_Q2) != 1:
            raise UsageError(f"{self.name}'s chat template does not keep a message's text as it is, so tforce "
                             "cannot place the document and questions in it; --template none gives the text as it is")
        self._head = one[:one.index(_CUT)]
        # whether the template strips a message's leading whitespace (Llama 3's `| trim`, Llama 2's .strip()),
        # as it does to run's whole message: the document's piece must then lose it too
        self._lstrip = self._render([{"role": "user", "content": " \n" + _CUT}]) == one
        self._close = one[one.index(_CUT) + len(_CUT):]
        self._between = two[two.index(_ANSWER) + len(_ANSWER):two.index(_Q2)]
        self._close_later = two[two.index(_Q2) + len(_Q2):]
        self._appends = two.startswith(one)  # the second turn leaves the first as it was alone (check_history)
