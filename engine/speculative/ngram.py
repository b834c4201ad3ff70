"""NGRAM: prompt lookup over the request's own tokens (SGLang's ``--speculative-algorithm NGRAM``).

The draft for a sequence is what followed the most recent earlier occurrence of its longest
suffix: suffixes of ``max_window`` tokens down to ``min_window`` tokens are looked up, the first
(longest) one found wins, and up to ``max_tokens`` of the tokens that followed it become a chain.
Outputs that copy from their prompt (edits, summaries, extraction, repeated tool arguments) are
where this guesses right; elsewhere it mostly finds nothing and costs nothing.

Per request an index maps each n-gram (``min_window <= n <= max_window``) to the end of its latest
occurrence that has a continuation. It is extended as tokens arrive (``O(max_window)`` per token),
so a step's lookup is ``O(max_window)`` dictionary probes whatever the sequence's length. The
tokens a sequence is given only grow (drafts never enter them; only accepted tokens do), so the
index is rebuilt only when a call's tokens are not an extension of what it saw (a new request under
a reused rid).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.speculative.proposer import Draft, DraftInput
from pdserve.engine.speculative_names import NGRAM


class _Index:
    """One sequence's n-gram index: n-gram -> exclusive end of its latest occurrence with a continuation."""

    def __init__(self, min_window: int, max_window: int):
        self.min_window = min_window
        self.max_window = max_window
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        """Take the tokens past those seen; the n-grams ending just before each new token gain it as continuation."""
        toks = self.tokens
        for t in token_ids[len(toks) :]:
            end = len(toks)  # the n-grams ending here have continuation t
            for n in range(self.min_window, min(self.max_window, end) + 1):
                self.ends[tuple(toks[end - n : end])] = end
            toks.append(t)

    def lookup(self, max_tokens: int) -> list[int]:
        toks = self.tokens
        for n in range(min(self.max_window, len(toks)), self.min_window - 1, -1):
            end = self.ends.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                return toks[end : end + max_tokens]
        return []


class NgramProposer:
    """A chain per sequence from prompt lookup; deterministic in the tokens, so every TP rank proposes alike."""

    name = NGRAM
    wants_hidden = False

    def __init__(self, min_window: int = 1, max_window: int = 12):
        if not 1 <= min_window <= max_window:
            raise ValueError(f"ngram windows must satisfy 1 <= min <= max, got {min_window} and {max_window}")
        self.min_window = min_window
        self.max_window = max_window
        self._indexes: dict[str, _Index] = {}

    @classmethod
    def from_config(cls, config, runner=None) -> "NgramProposer":
        return cls(config.speculative_ngram_min_match_window_size, config.speculative_ngram_max_match_window_size)

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return [Draft.chain(self._index(i.rid, i.token_ids).lookup(i.max_tokens)) if i.max_tokens > 0 else Draft()
                for i in inputs]

    def _index(self, rid: str, token_ids: Sequence[int]) -> _Index:
        index = self._indexes.get(rid)
        n = 0 if index is None else len(index.tokens)
        if index is None or len(token_ids) < n or (n and token_ids[n - 1] != index.tokens[-1]):
            index = self._indexes[rid] = _Index(self.min_window, self.max_window)
        index.extend(token_ids)
        return index

    def release(self, rid: str) -> None:
        self._indexes.pop(rid, None)

    def close(self) -> None:
        self._indexes.clear()
