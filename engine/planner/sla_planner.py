"""The SLA planner's state between intervals: predictors of the load, correction factors, the last
decision and each role's last change. ``step()`` takes one interval's observation (or None for a
failed scrape) and returns the decision; no sockets, no clock of its own (``now`` is passed in), so
the simulator and the process drive the same object.

An observation that is missing or nonsense (negative or non-finite figures, no requests but
latencies, a rate above ``MAX_RATE``) is not used: the planner holds its last decision and counts
the failure.
"""

from __future__ import annotations

import math

import msgspec

from pdserve.engine.planner.correction import Correction
from pdserve.engine.planner.perf_model import DecodeModel, PrefillModel
from pdserve.engine.planner.predictor import make_predictor
from pdserve.engine.planner.profile import Profile
from pdserve.engine.planner.scaling import Counts, Decision, Limits, Load, Slo, decide, predict_itl, predict_ttft

MAX_RATE = 1e6  # requests/s no router reports: a counter reset or a parse error


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    """One interval at the router: the means over the interval, None where nothing was measured."""

    interval_s: float
    rate: float  # requests finished per second
    input_len: float | None = None
    output_len: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """What one interval decided, with its inputs (logged and exposed as metrics)."""

    time: float
    observation: Observation | None
    predicted: Load | None
    corrections: tuple[float, float]
    decision: Decision
    held: bool  # the observation was unusable: the last decision stands
    why_held: str = ""


def check_observation(obs: Observation | None) -> str:
    """Why ``obs`` cannot be used ("" when it can)."""
    if obs is None:
        return "scrape failed"
    values = {"interval_s": obs.interval_s, "rate": obs.rate, "input_len": obs.input_len,
              "output_len": obs.output_len, "ttft_s": obs.ttft_s, "itl_s": obs.itl_s}
    for name, v in values.items():
        if v is not None and (not math.isfinite(v) or v < 0):
            return f"{name} is {v}"
    if obs.interval_s <= 0:
        return "interval_s is 0"
    if obs.rate > MAX_RATE:
        return f"rate {obs.rate:g}/s is beyond any router (a counter reset?)"
    return ""


class SlaPlanner:
    def __init__(self, prefill_profile: Profile, decode_profile: Profile, slo: Slo, limits: Limits,
                 initial: Counts, predictor: str = "constant", window: int = 3, smoothing: float = 0.5,
                 now: float = 0.0):
        self.prefill_model = PrefillModel(prefill_profile)
        self.decode_model = DecodeModel(decode_profile)
        self.slo, self.limits = slo, limits
        self.predictors = {k: make_predictor(predictor, window) for k in ("rate", "input_len", "output_len")}
        self.prefill_corr, self.decode_corr = Correction(smoothing), Correction(smoothing)
        self.counts = initial
        self.last_change = [now, now]
        self.failures = 0
        self.last_load: Load | None = None

    def _observe(self, obs: Observation) -> None:
        # corrections compare what was seen with what the model predicts for the load just seen
        # at the counts that served it
        load = Load(obs.rate, obs.input_len or 0.0, obs.output_len or 0.0)
        if obs.rate > 0 and obs.input_len:
            expected = predict_ttft(self.prefill_model, load, self.counts.prefill)
            if math.isfinite(expected):
                self.prefill_corr.observe(obs.ttft_s, expected)
        if obs.rate > 0 and obs.input_len and obs.output_len:
            expected, _ = predict_itl(self.decode_model, load, self.counts.decode)
            if math.isfinite(expected):
                self.decode_corr.observe(obs.itl_s, expected)
        self.predictors["rate"].observe(obs.rate)
        # lengths are kept from the last interval that had requests: an idle interval says nothing
        if obs.input_len:
            self.predictors["input_len"].observe(obs.input_len)
        if obs.output_len:
            self.predictors["output_len"].observe(obs.output_len)

    def predicted_load(self) -> Load | None:
        rate = self.predictors["rate"].predict()
        if rate is None:
            return None
        return Load(rate, self.predictors["input_len"].predict() or 1.0,
                    self.predictors["output_len"].predict() or 1.0)

    def step(self, now: float, obs: Observation | None, current: Counts | None = None) -> Step:
        """One interval. ``current``: the servers the connector counts as capacity now (those that
        failed to start are not); None: the last decision's counts."""
        if current is not None:
            self.counts = current
        corrections = (self.prefill_corr.factor, self.decode_corr.factor)
        why = check_observation(obs)
        if why:
            self.failures += 1
            return Step(time=now, observation=obs, predicted=self.last_load, corrections=corrections,
                        decision=Decision(counts=self.counts, needed=self.counts, reasons=(f"held: {why}",)),
                        held=True, why_held=why)
        self._observe(obs)
        load = self.predicted_load()
        self.last_load = load
        corrections = (self.prefill_corr.factor, self.decode_corr.factor)
        since = (now - self.last_change[0], now - self.last_change[1])
        decision = decide(self.prefill_model, self.decode_model, load, self.slo, self.limits, self.counts,
                          since, corrections)
        new = decision.counts
        if new.prefill != self.counts.prefill:
            self.last_change[0] = now
        if new.decode != self.counts.decode:
            self.last_change[1] = now
        self.counts = new
        return Step(time=now, observation=obs, predicted=load, corrections=corrections, decision=decision,
                    held=False)
