"""How much of a growing text to hold back because it may be the start of a stop string.

One Knuth-Morris-Pratt automaton per stop string follows the text as it grows: its state is the
longest prefix of the stop string that the text ends with, advanced in amortized constant time per
new character. The whole output thus costs time linear in its length for each stop string, where
testing every prefix of every stop string at every token costs the square of the stop string's
length per token.
"""

from __future__ import annotations

from typing import Sequence


def _failure(s: str) -> list[int]:
    """KMP's prefix function: fail[i] is the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopPrefixTracker:
    """The longest suffix of the text fed so far that is a proper prefix of one of ``stops``."""

    def __init__(self, stops: Sequence[str]):
        self._stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)

    def feed(self, text: str) -> None:
        """Take the characters appended to the text since the last call."""
        for j, s in enumerate(self._stops):
            fail, k, last = self._fail[j], self._state[j], len(s)
            for c in text:
                while k and (k == last or s[k] != c):
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
            self._state[j] = k

    def holdback(self) -> int:
        """Characters at the end of the text that may begin a stop string (a whole one is not held)."""
        best = 0
        for s, fail, k in zip(self._stops, self._fail, self._state):
            if k == len(s):  # a whole match: what is held is its longest proper prefix ending here
                k = fail[k - 1]
            best = max(best, k)
        return best
