"""The speculation hierarchy as composition.

A Node is one network with one cache and the record of the tokens that cache holds. Nodes catch up
by themselves: asked for distributions after the first n tokens of the shared sequence buffer, a node
rolls its cache back to the longest prefix it holds that still matches the buffer (dropping rejected
speculation) and feeds only the rest. No object patches another's cache.

A Level produces tokens together with the distribution each was drawn from:
- Drafter(node): autoregressive sampling from the node, one token per round.
- SpecLevel(proposer, node, gamma): the proposer drafts gamma tokens, the node verifies them with
  speculative sampling, and the round yields the accepted tokens plus the residual or bonus token,
  each labelled with the *node's* distribution at its position. The yielded sequence is an exact sample
  of the node's own distribution, so a SpecLevel is itself a proposer for the level above: that is
  the whole hierarchy (triforce = SpecLevel(SpecLevel(Drafter(draft), middle, g1), full, g2)).

Host and device. The shared sequence buffer and each node's record of its tokens live on the host;
token ids reach the device through sync.to_device (no sync). The device -> host transfers of a decode
step all go through sync.host: one per drafted token (Drafter.round: the token joins the host-side
sequence that catch-up compares against) and one per verification (speculative.verify). So a triforce
round of gamma2 tokens from gamma1-token middle rounds costs about gamma2 draft syncs plus one per middle
round plus one. Keeping drafted tokens on the device until a verification would save the draft syncs;
it needs a device-side sequence buffer and a catch-up rule that does not compare token values, not
done.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import Sampling
from .sampling import sample, to_probs
from .speculative import Proposal, verify
from .sync import host, to_device
from .timing import ForwardTimer
from .vocab import SharedVocabulary


class Node:
    def __init__(self, name: str, model, cache, sampling: Sampling, capacity: int, prefill_chunk: int = 512,
                 runner=None, vocab: SharedVocabulary | None = None):
        """vocab: a draft's mapping into the target's ids when its embedding table is shorter (vocab.py)."""
        self.name, self.model, self.cache, self.sampling, self.vocab = name, model, cache, sampling, vocab
        # runner(ids, last_n) replaces model(ids, cache, last_n) when given (graphs.GraphRunner)
        self.runner = runner or (lambda ids, last_n: model(ids, cache, last_n=last_n))
        self.tokens = torch.zeros(capacity, dtype=torch.long)  # what the cache holds: tokens[:cache.length]
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.forwards = 0
        self.timer = ForwardTimer(self.device)  # seconds in forwards, read after decoding (stage times)

    def matching(self, seq: torch.Tensor, n: int) -> int:
        """How many of the tokens the cache holds match seq[:n - 1] (the prefix sync would keep)."""
        m = min(self.cache.length, n - 1)
        diff = (self.tokens[:m] != seq[:m]).nonzero()
        return int(diff[0]) if len(diff) else m

    def sync(self, seq: torch.Tensor, n: int) -> int:
        """Roll back to the matching prefix of seq[:n] and return where feeding must start (<= n - 1)."""
        keep = self.matching(seq, n)
        if keep < self.cache.length:
            self.cache.truncate(keep)
        return keep

    def _feed(self, seq: torch.Tensor, start: int, end: int, last_n: int):
        ids = seq[start:end]
        self.cache.begin(len(ids))
        mark = self.timer.start()
        fed = ids if self.vocab is None else self.vocab.ids(ids)
        logits = self.runner(to_device(fed[None], self.device), last_n)
        self.timer.stop(mark)
        self.cache.commit(len(ids))
        self.tokens[start:end] = ids
        self.forwards += 1
        return logits

    def probs(self, seq: torch.Tensor, n: int, last: int = 1) -> torch.Tensor:
        """Distributions (last, V) of the next token after each of seq[:n - last + 1], ..., seq[:n]."""
        start = min(self.sync(seq, n), n - last)
        if start < self.cache.length:  # the logits of tokens it already holds are wanted: feed them again
            self.cache.truncate(start)
        while n - start > self.prefill_chunk + last:  # catching up on a long stretch: in chunks
            step = min(self.prefill_chunk, n - last - start)
            self._feed(seq, start, start + step, last_n=0)
            start += step
        logits = self._feed(seq, start, n, last_n=last)[0]  # (last, V)
        if self.vocab is not None:
            logits = self.vocab.logits(logits)
        return to_probs(logits, self.sampling)

    def adopt(self, seq: torch.Tensor, length: int) -> None:
        """The cache was filled outside a forward (a rebuild, a layer-major prefill) to hold seq[:length]."""
        assert self.cache.length == length
        self.tokens[:length] = seq[:length]

    def prefill(self, seq: torch.Tensor, n: int, progress=None) -> None:
        """Feed seq[:n] in chunks, computing no logits; progress(done, total) after each chunk."""
        start = self.sync(seq, n + 1)
        while start < n:
            end = min(start + self.prefill_chunk, n)
            self._feed(seq, start, end, last_n=0)
            start = end
            if progress:
                progress(start, n)


@dataclass
class LevelStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    recent: list = field(default_factory=list)  # acceptance of recent rounds, for rebuild decisions

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class Level:
    """Produces tokens continuing seq[:n], each with the distribution it was drawn from."""

    def round(self, seq: torch.Tensor, n: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
        raise NotImplementedError

    def propose(self, seq: torch.Tensor, n: int, k: int, gen: torch.Generator) -> Proposal:
        """Exactly k tokens (writing them into seq[n:n + k]) with their distributions."""
        tokens, probs, m = [], [], n
        while len(tokens) < k:
            t, p = self.round(seq, m, gen)
            tokens += t
            probs.append(p)
            m += len(t)
        probs = torch.cat(probs)[:k]
        return Proposal(to_device(torch.tensor(tokens[:k]), probs.device), probs)


class Drafter(Level):
    def __init__(self, node: Node):
        self.node = node

    def round(self, seq, n, gen):
        p = self.node.probs(seq, n)  # (1, V)
        # A host sync per drafted token: the token joins the host-side sequence that every node's
        # catch-up (Node.sync) compares against. The verification's sync comes on top (speculative.py).
        [token] = host(sample(p, gen))
        seq[n] = token
        return [token], p


REBUILD_WINDOW = 8  # rounds whose mean acceptance the low-acceptance rebuild rule reads (Session._maybe_rebuild)


class SpecLevel(Level):
    def __init__(self, proposer: Level, node: Node, gamma: int, window: int = REBUILD_WINDOW):
        self.proposer, self.node, self.gamma, self.window = proposer, node, gamma, window
        self.stats = LevelStats()

    def round(self, seq, n, gen):
        proposal = self.proposer.propose(seq, n, self.gamma, gen)  # writes seq[n:n + gamma] (host)
        p = self.node.probs(seq, n + self.gamma, last=self.gamma + 1)  # (gamma + 1, V)
        [n_accepted], [next_token] = verify(proposal.tokens[None], proposal.probs[None],
                                            p.to(proposal.probs.device)[None], gen)
        tokens = seq[n:n + n_accepted].tolist() + [next_token]
        seq[n:n + len(tokens)] = torch.tensor(tokens)
        self._count(n_accepted)
        return tokens, p[:len(tokens)]

    def _count(self, n_accepted: int) -> None:
        s = self.stats
        s.rounds += 1
        s.drafted += self.gamma
        s.accepted += n_accepted
        s.recent = (s.recent + [n_accepted / self.gamma])[-self.window:]
