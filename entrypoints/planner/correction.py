"""Correction factors: how far the servers' observed latencies are from what the profile predicts
for the same load, smoothed over intervals.

A factor above 1 means the servers are slower than profiled (other tenants on the machine, a
longer real context, a colder cache); the scaling rule multiplies the profile's times by it. Each
interval's ratio is folded in with exponential smoothing and the factor is clamped, so that one
odd interval (a scrape right after a restart) cannot swing the pools.
"""

from __future__ import annotations

import math

MIN_FACTOR, MAX_FACTOR = 0.2, 5.0


class Correction:
    def __init__(self, smoothing: float = 0.5):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"correction smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.factor = 1.0

    def observe(self, observed: float | None, predicted: float | None) -> float:
        """Fold in one interval's observed / predicted ratio (skipped when either is missing,
        zero or not finite); returns the factor."""
        if observed is None or predicted is None or not (observed > 0 and predicted > 0):
            return self.factor
        if not (math.isfinite(observed) and math.isfinite(predicted)):
            return self.factor
        ratio = min(MAX_FACTOR, max(MIN_FACTOR, observed / predicted))
        # in log space: a 2x-slow and a 2x-fast interval average back to 1
        log_f = (1 - self.smoothing) * math.log(self.factor) + self.smoothing * math.log(ratio)
        self.factor = min(MAX_FACTOR, max(MIN_FACTOR, math.exp(log_f)))
        return self.factor
