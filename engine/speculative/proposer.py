"""The interface every proposer implements: a request's tokens in, draft tokens out.

A proposer is asked once per decode step for the sequences that speculate in it. It returns, per
sequence, a small tree of draft tokens (a chain is the common case: ``parents == [-1, 0, 1, ...]``)
which the target model scores in one verify forward; the longest accepted path plus one bonus
token is kept. A proposer keeps whatever state it likes per request (an n-gram index, a draft
model's KV), keyed by ``rid``, and must be told when a request ends (``release``). It learns what
was accepted from the ``token_ids`` of the next call: everything past their common prefix with
what it saw before was rejected.

A proposer that drafts from the target's hidden states (``wants_hidden``: NEXTN) also has
``observe(rid, start, hidden)``: after every target step of a speculating request, the hidden
states [n, hidden] that step made valid, at positions ``start ..`` (``Speculation.observe``);
NGRAM and STANDALONE do not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence


@dataclass(frozen=True)
class DraftInput:
    rid: str
    # the prompt and every output token so far; the last one is the token the next step feeds
    token_ids: Sequence[int]
    # the most draft tokens wanted (the tree's size), 1..speculative_num_draft_tokens
    max_tokens: int
    # a proposer drafting over the target's KV (``shares_target_kv``): the request's pages, reserved
    # for ``kv_len + 1 + max_tokens`` tokens, and ``kv_len``, the tokens whose K/V they hold (all but
    # the last); None for the others
    pages: Sequence[int] | None = None
    kv_len: int | None = None


@dataclass(frozen=True)
class Draft:
    tokens: list[int] = field(default_factory=list)
    # parents[i]: the index in ``tokens`` of token i's parent; -1: the step's fed token. Parents
    # come before their children. A chain of k tokens is [-1, 0, ..., k - 2].
    parents: list[int] = field(default_factory=list)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft needs one parent per token, got {len(self.tokens)} tokens and "
                             f"{len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft token {i}'s parent {p} must be -1 or an earlier token")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "Draft":
        return cls(list(tokens), chain_parents(len(tokens)))


def chains_at(n: int, picks: Iterable[tuple[int, Sequence[int]]]) -> list[Draft]:
    """``n`` drafts, empty but at each (index, tokens) of ``picks``: there the chain of those tokens
    (the draft-model proposers' answer to ``propose``)."""
    drafts = [Draft() for _ in range(n)]
    for i, tokens in picks:
        drafts[i] = Draft.chain(tokens)
    return drafts


def chain_parents(n: int) -> list[int]:
    """The parents of a chain of ``n`` draft tokens: each the child of the one before."""
    return list(range(-1, n - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return list(parents) == chain_parents(len(parents))


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """``children[node + 1]``: the children of ``node`` (-1: the fed token) in index order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, p in enumerate(parents):
        children[p + 1].append(j)
    return children


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (the fed token is depth 0, its children 1); parents come before children."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


class Proposer(Protocol):
    name: str  # the speculative_algorithm it implements
    wants_hidden: bool

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        """One draft per input, in order; an empty draft means: no guess for this sequence."""
        ...

    def release(self, rid: str) -> None:
        """The request ended: drop its state (and, for a draft model, free its KV pages)."""
        ...

    def close(self) -> None:
        ...
