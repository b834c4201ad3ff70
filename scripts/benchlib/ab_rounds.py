"""Two or more sides measured in the same run, taking turns: each round's times, and the ratio
of two sides as the median of the rounds' ratios with its spread.

On a shared machine a best-of-N ratio rewards whichever side met the quietest moment; timing the
sides in alternation (A B, then B A, so neither always goes first) and taking the median of the
per-round ratios gives a figure that another loaded run reproduces, and the spread says how far.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(sides: dict, call: Callable, repeats: int = 1) -> dict[str, tuple[object, float, list[float]]]:
    """Each side's output of ``call(side)``, its best wall time of ``repeats`` rounds and every
    round's time. The sides take turns within each round, in reverse order every other round
    (A B, B A, ...), so that a loaded moment on a shared machine, or going first, hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    out: dict[str, object] = {}
    for r in range(repeats):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            t0 = time.perf_counter()
            out[name] = call(sides[name])
            times[name].append(time.perf_counter() - t0)
    return {name: (out[name], min(ts), ts) for name, ts in times.items()}


def round_ratios(num: list[float], den: list[float]) -> dict[str, float]:
    """The per-round speed ratios of two sides timed in the same rounds (``num``'s speed over
    ``den``'s: ``den``'s time over ``num``'s): their median and their spread (min, max). Unlike the
    best-of ratio, the median holds when one side happened to meet a quiet moment."""
    rs = sorted(d / n for n, d in zip(num, den))
    mid = len(rs) // 2
    median = rs[mid] if len(rs) % 2 else (rs[mid - 1] + rs[mid]) / 2
    return {"median": median, "min": rs[0], "max": rs[-1]}
