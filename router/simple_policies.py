"""Policies that need no request text: random, round robin, power of two choices."""

from __future__ import annotations

import random

from pdserve.router.policy import Policy


class RandomPolicy(Policy):
    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def select(self, endpoints, text):
        return endpoints[self._rng.randrange(len(endpoints))]


class RoundRobinPolicy(Policy):
    def __init__(self):
        self._next = 0

    def select(self, endpoints, text):
        i = self._next % len(endpoints)
        self._next = i + 1
        return endpoints[i]


class PowerOfTwoPolicy(Policy):
    """Two random candidates; the one with fewer requests in flight (per worker and DP rank)."""

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def select(self, endpoints, text):
        n = len(endpoints)
        if n == 1:
            return endpoints[0]
        i, j = self._rng.sample(range(n), 2)
        a, b = endpoints[i], endpoints[j]
        return b if b.load < a.load else a
