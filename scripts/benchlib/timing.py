"""Timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import time
from typing import Callable


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Best wall seconds of ``repeats`` calls of ``fn`` after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
