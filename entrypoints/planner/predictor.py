"""Load predictors: from the values observed at the end of each adjustment interval (request rate,
mean input and output length), the value expected over the next interval.

- ``constant``: the next interval is like the last. It follows a change within one interval,
  which is what a rising daily rate and a burst need; its cost is that a noisy interval moves
  the decision (the scale-down cooldown absorbs most of that).
- ``moving_average``: the mean of the last ``window`` intervals. It ignores one noisy interval
  but lags a rise by about half its window: under-provisioning while traffic grows.
- ``peak``: the largest of the last ``window`` intervals; reacts at once to a rise, and holds
  the capacity through the window after a fall (a conservative constant).

The default is ``peak`` over 4 intervals: on the benchmark's trace (scripts/bench_planner.py, which
runs all three in one invocation; results/planner.md) it kept the most requests within the SLOs
for the least server-seconds, because a server asked for now serves only after its start-up, so
under-provisioning during a rise costs more than holding capacity one minute longer after a fall.
"""

from __future__ import annotations

from collections import deque

PREDICTORS = ("constant", "moving_average", "peak")


class Predictor:
    """Feed ``observe(value)`` once per interval; ``predict()`` is the next interval's value
    (None before the first observation)."""

    def observe(self, value: float) -> None:
        raise NotImplementedError

    def predict(self) -> float | None:
        raise NotImplementedError


class ConstantPredictor(Predictor):
    def __init__(self):
        self.last: float | None = None

    def observe(self, value: float) -> None:
        self.last = value

    def predict(self) -> float | None:
        return self.last


class MovingAveragePredictor(Predictor):
    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"predictor window must be >= 1, got {window}")
        self.values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self.values.append(value)

    def predict(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


class PeakPredictor(MovingAveragePredictor):
    def predict(self) -> float | None:
        return max(self.values) if self.values else None


def make_predictor(name: str, window: int = 3) -> Predictor:
    if name == "constant":
        return ConstantPredictor()
    if name == "moving_average":
        return MovingAveragePredictor(window)
    if name == "peak":
        return PeakPredictor(window)
    raise ValueError(f"predictor must be one of {PREDICTORS}, got {name!r}")
