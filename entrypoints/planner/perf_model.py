"""The performance a profile predicts: prefill TTFT against input length, decode ITL against batch
size and context length, by piecewise-linear interpolation between the measured points and linear
extrapolation past the ends (slope of the last segment, never negative).

Pure functions over the profile's points; no measurement here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from pdserve.entrypoints.planner.profile import Profile

# the largest decode batch the planner considers when the profile gives no KV capacity
DEFAULT_MAX_BATCH = 256


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through sorted ``xs``; linear past the ends, with the end segments'
    slopes (0 below the first point when the slope is negative), and never below a tiny positive."""
    n = len(xs)
    if n == 1:
        return ys[0]
    if x <= xs[0]:
        slope = max(0.0, (ys[1] - ys[0]) / (xs[1] - xs[0]))
        return max(ys[0] + slope * (x - xs[0]), ys[0] * 0.05)
    if x >= xs[-1]:
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (x - xs[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class PrefillModel:
    """TTFT of one request alone on an idle prefill server, against its input length."""

    def __init__(self, profile: Profile):
        pts = sorted({p.input_len: p.ttft_s for p in profile.prefill}.items())
        self.xs = [float(x) for x, _ in pts]
        self.ys = [y for _, y in pts]

    def ttft(self, input_len: float) -> float:
        return _interp(self.xs, self.ys, max(1.0, input_len))

    def tokens_per_s(self, input_len: float) -> float:
        return max(1.0, input_len) / self.ttft(input_len)


class DecodeModel:
    """Mean inter-token latency of a decode server with ``batch`` sequences of ``context`` tokens
    running: interpolated over batch size on each measured context length, then across those."""

    def __init__(self, profile: Profile):
        curves: dict[int, dict[int, float]] = {}
        for d in profile.decode:
            curves.setdefault(d.context_len, {})[d.batch_size] = d.itl_s
        self.contexts = [float(c) for c in sorted(curves)]
        self.curves = []
        for c in sorted(curves):
            pts = sorted(curves[c].items())
            # a step with more sequences never takes less time: a noisy dip would invite overload
            ys, top = [], 0.0
            for _, y in pts:
                top = max(top, y)
                ys.append(top)
            self.curves.append(([float(b) for b, _ in pts], ys))
        kv = profile.server.max_total_tokens
        self.kv_tokens = kv if kv > 0 else None

    def itl(self, batch: float, context: float) -> float:
        batch = max(1.0, batch)
        per_ctx = [_interp(xs, ys, batch) for xs, ys in self.curves]
        return _interp(self.contexts, per_ctx, max(1.0, context))

    def max_batch(self, itl_slo: float, context: float, cap: int = DEFAULT_MAX_BATCH) -> int:
        """The largest batch (>= 0) whose ITL at ``context`` meets ``itl_slo``, within the KV
        capacity when the profile knows it and within ``cap``; 0 when not even one sequence meets it."""
        if self.kv_tokens is not None:
            cap = min(cap, max(1, int(self.kv_tokens // max(1.0, context))))
        lo, hi = 0, cap  # itl is non-decreasing in batch: bisect the last batch that meets the SLO
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.itl(mid, context) <= itl_slo:
                lo = mid
            else:
                hi = mid - 1
        return lo
