"""A draft and its target must speak one tokenizer; the draft's embedding table may be the shorter one.

Publishers pad embedding tables to a round size: Qwen2.5-0.5B has 151,936 rows and Qwen2.5-7B 152,064,
over the same tokenizer (151,665 ids). A draft like that is run over the target's id space (docs/models.md):
- its distributions are padded with zeros over the ids it lacks (logits of -inf before sampling), so
  speculative sampling stays exact: the proposal is the distribution the token was drawn from;
- an id it lacks (only the target can produce one) reaches its embedding as PLACEHOLDER: the draft guesses
  worse after such a token, and the verification, which never reads the draft's guess as the answer,
  keeps the output the target's.
A draft whose table is larger than the target's, or whose tokenizer maps text to other ids, is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UsageError

PLACEHOLDER = 0  # the id a draft reads in place of one outside its table


class SharedVocabulary:
    """Maps one node's ids and logits into the shared id space of `size` ids (the target's table)."""

    def __init__(self, own: int, size: int):
        self.own, self.size = own, size

    def ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids of the shared space -> ids this node's embedding table holds."""
        return ids.masked_fill(ids >= self.own, PLACEHOLDER)

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., own) -> (..., size): -inf over the ids the node cannot produce."""
        return F.pad(logits, (0, self.size - self.own), value=float("-inf"))


def shared_vocabulary(model, target_vocab: int) -> SharedVocabulary | None:
    """The mapping a draft needs to run over the target's ids, or None when the tables are the same size."""
    own = model.config.vocab_size
    return None if own == target_vocab else SharedVocabulary(own, target_vocab)


def check_sizes(target_vocab: int, draft_vocab: int) -> None:
    if draft_vocab > target_vocab:
        raise UsageError(f"the draft's vocabulary ({draft_vocab} tokens) is larger than the target's "
                         f"({target_vocab}): the draft must share the target's tokenizer")


def check_tokenizers(target_tok, draft_tok, draft_name: str, target_vocab: int, draft_vocab: int) -> None:
    """Refuses a draft whose tokenizer gives other ids than the target's: their token -> id maps must agree
    on the ids below the shorter embedding table (tokens a tokenizer adds past it, such as a padding token,
    are not compared). Where either tokenizer is missing nothing can be compared, and only a draft with the
    target's own table size is taken (a table of another size is a tokenizer of another size)."""
    if target_tok is None or draft_tok is None:
        if target_vocab != draft_vocab:
            missing = "the target's" if target_tok is None else "the draft's"
            raise UsageError(f"the draft {draft_name} has {draft_vocab} embedding rows, the target {target_vocab}, and "
                             f"{missing} tokenizer is missing, so the two cannot be compared: a draft must share "
                             "the target's tokenizer (give both folders their tokenizer files)")
        return
    rows = min(target_vocab, draft_vocab)
    ours, theirs = _below(target_tok.get_vocab(), rows), _below(draft_tok.get_vocab(), rows)
    if ours == theirs:
        return
    differ = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
    raise UsageError(f"the draft {draft_name} has another tokenizer than the target ({len(differ)} tokens differ, "
                     f"e.g. {differ[0]!r}): a draft must share the target's tokenizer")


def _below(vocab: dict, rows: int) -> dict:
    return {t: i for t, i in vocab.items() if i < rows}
