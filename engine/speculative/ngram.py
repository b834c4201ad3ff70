"""NGRAM: prompt lookup over the request's own tokens (SGLang's ``--speculative-algorithm NGRAM``).

The draft for a sequence is what followed the most recent earlier occurrence of its longest
suffix: suffixes of ``max_window`` tokens down to ``min_window`` tokens are looked up, the first
(longest) one found wins, and up to ``max_tokens`` of the tokens that followed it become a chain.
With ``branches > 1`` (``--speculative-ngram-branches``) the continuations after that many latest
occurrences (of the longest suffix, then of shorter ones) are merged into a prefix tree of at most
``max_tokens`` nodes (``merge_tree``), which one verify forward scores in full. Outputs that copy
from their prompt (edits, summaries, extraction, repeated tool arguments) are where this guesses
right; elsewhere it mostly finds nothing and costs nothing.

Per request an index maps each n-gram (``min_window <= n <= max_window``) to the ends of its latest
``branches`` occurrences that have a continuation. It is extended as tokens arrive
(``O(max_window * branches)`` per token), so a step's lookup is ``O(max_window)`` dictionary probes
whatever the sequence's length. The tokens a sequence is given only grow (drafts never enter them;
only accepted tokens do), so the index is rebuilt only when a call's tokens are not an extension of
what it saw (a new request under a reused rid).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.speculative.proposer import Draft, DraftInput
from pdserve.engine.speculative_names import NGRAM

# the weights that rank a tree's nodes (merge_tree), chosen on bench_spec's copy and chat workloads
# (docs/SPECULATIVE.md, "Trees")
RANK_WEIGHT = 0.6
DEPTH_WEIGHT = 0.7


class _Index:
    """One sequence's n-gram index: n-gram -> exclusive ends of its latest ``keep`` occurrences with a
    continuation, most recent last."""

    def __init__(self, min_window: int, max_window: int, keep: int = 1):
        self.min_window = min_window
        self.max_window = max_window
        self.keep = keep
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int] | int] = {}  # keep == 1: the end itself

    def extend(self, token_ids: Sequence[int]) -> None:
        """Take the tokens past those seen; the n-grams ending just before each new token gain it as continuation."""
        toks = self.tokens
        ends, keep = self.ends, self.keep
        for t in token_ids[len(toks) :]:
            end = len(toks)  # the n-grams ending here have continuation t
            for n in range(self.min_window, min(self.max_window, end) + 1):
                key = tuple(toks[end - n : end])
                if keep == 1:  # a chain: the latest end alone, no list (half the cost per token)
                    ends[key] = end
                    continue
                got = ends.get(key)
                if got is None:
                    ends[key] = [end]
                else:
                    got.append(end)
                    if len(got) > keep:
                        del got[0]
            toks.append(t)

    def candidates(self, max_tokens: int, branches: int) -> list[list[int]]:
        """Up to ``branches`` continuations (each at most ``max_tokens``), best first: the latest
        occurrences of the longest matching suffix, then of shorter suffixes, one per occurrence."""
        toks = self.tokens
        out: list[list[int]] = []
        seen: set[int] = set()
        for n in range(min(self.max_window, len(toks)), self.min_window - 1, -1):
            got = self.ends.get(tuple(toks[len(toks) - n :]))
            for end in (() if got is None else (got,) if isinstance(got, int) else reversed(got)):
                if end not in seen:
                    seen.add(end)
                    out.append(toks[end : end + max_tokens])
                    if len(out) == branches:
                        return out
        return out

    def lookup(self, max_tokens: int) -> list[int]:
        got = self.candidates(max_tokens, 1)
        return got[0] if got else []


def merge_tree(candidates: Sequence[Sequence[int]], max_tokens: int, rank_weight: float = RANK_WEIGHT,
               depth_weight: float = DEPTH_WEIGHT) -> Draft:
    """The candidates' prefix tree (shared prefixes one node; siblings distinct tokens), cut to the
    ``max_tokens`` nodes most likely reached: a node scores ``rank_weight ** r * depth_weight ** d``
    for the best rank ``r`` of the candidates through it and its depth ``d``, so a parent always
    scores at least its child and the kept nodes form a tree. Nodes come in depth-first order, the
    best candidate first, so a single candidate is a chain and the first chain is the best candidate."""
    # node: [token, parent node or -1, score, children]
    nodes: list[list] = []
    child_of: dict[tuple[int, int], int] = {}
    for rank, cand in enumerate(candidates):
        parent = -1
        for depth, tok in enumerate(cand, 1):
            score = rank_weight ** rank * depth_weight ** depth
            j = child_of.get((parent, tok))
            if j is None:
                j = child_of[(parent, tok)] = len(nodes)
                nodes.append([tok, parent, score, []])
                if parent >= 0:
                    nodes[parent][3].append(j)
            else:
                nodes[j][2] = max(nodes[j][2], score)
            parent = j
    # ties: shallower, then earlier created (a parent is created before its child)
    kept = set(sorted(range(len(nodes)), key=lambda j: -nodes[j][2])[:max_tokens])
    tokens: list[int] = []
    parents: list[int] = []
    stack = [(j, -1) for j in reversed([j for j in range(len(nodes)) if nodes[j][1] == -1]) if j in kept]
    while stack:  # depth-first, children in creation (rank) order
        j, new_parent = stack.pop()
        tokens.append(nodes[j][0])
        parents.append(new_parent)
        me = len(tokens) - 1
        stack.extend((c, me) for c in reversed(nodes[j][3]) if c in kept)
    return Draft(tokens, parents)


class NgramProposer:
    """A draft tree per sequence from prompt lookup; deterministic in the tokens, so every TP rank proposes alike."""

    name = NGRAM
    wants_hidden = False

    def __init__(self, min_window: int = 1, max_window: int = 12, branches: int = 1):
        if not 1 <= min_window <= max_window:
            raise ValueError(f"ngram windows must satisfy 1 <= min <= max, got {min_window} and {max_window}")
        if branches < 1:
            raise ValueError(f"ngram branches must be >= 1, got {branches}")
        self.min_window = min_window
        self.max_window = max_window
        self.branches = branches
        self._indexes: dict[str, _Index] = {}

    @classmethod
    def from_config(cls, config, runner=None) -> "NgramProposer":
        return cls(config.speculative_ngram_min_match_window_size, config.speculative_ngram_max_match_window_size,
                   config.speculative_ngram_branches)

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        out = []
        for i in inputs:
            if i.max_tokens <= 0:
                out.append(Draft())
                continue
            index = self._index(i.rid, i.token_ids)
            if self.branches == 1:  # a chain: no tree to merge (this runs for every request at every step)
                out.append(Draft.chain(index.lookup(i.max_tokens)))
                continue
            out.append(merge_tree(index.candidates(i.max_tokens, self.branches), i.max_tokens))
        return out

    def _index(self, rid: str, token_ids: Sequence[int]) -> _Index:
        index = self._indexes.get(rid)
        n = 0 if index is None else len(index.tokens)
        if index is None or len(token_ids) < n or (n and token_ids[n - 1] != index.tokens[-1]):
            index = self._indexes[rid] = _Index(self.min_window, self.max_window, self.branches)
        index.extend(token_ids)
        return index

    def release(self, rid: str) -> None:
        self._indexes.pop(rid, None)

    def close(self) -> None:
        self._indexes.clear()
