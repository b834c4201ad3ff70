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
from collections import deque

import msgspec

from pdserve.entrypoints.planner.correction import Correction
from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel
from pdserve.entrypoints.planner.predictor import make_predictor
from pdserve.entrypoints.planner.profile import Profile
from pdserve.entrypoints.planner.scaling import (Counts, Decision, Limits, Load, Slo, decide, decode_context, token_batch,
                                            mean_ttft_lower)

LENGTH_WINDOW = 10  # intervals the mean input and output lengths are taken over
MAX_RATE = 1e6  # requests/s no router reports: a counter reset or a parse error


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    """One interval at the router: the means over the interval, None where nothing was measured."""

    interval_s: float
    rate: float  # requests finished per second
    input_len: float | None = None
    output_len: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    # servers that served in the interval (ready, not starting); None: the planner's own counts
    prefill_servers: float | None = None
    decode_servers: float | None = None
    # sequences running per serving decode server (the batch the ITL was measured at)
    decode_batch: float | None = None
    # prompts waiting at the prefill servers at the interval's end: a backlog to clear
    prefill_queue: float | None = None


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
              "output_len": obs.output_len, "ttft_s": obs.ttft_s, "itl_s": obs.itl_s,
              "prefill_servers": obs.prefill_servers, "decode_servers": obs.decode_servers,
              "decode_batch": obs.decode_batch, "prefill_queue": obs.prefill_queue}
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
                 initial: Counts, predictor: str = "peak", window: int = 4, smoothing: float = 0.5,
                 now: float = 0.0, correct: bool = True):
        self.prefill_model = PrefillModel(prefill_profile)
        self.decode_model = DecodeModel(decode_profile)
        self.slo, self.limits = slo, limits
        self.rate = make_predictor(predictor, window)
        # lengths: means over the last LENGTH_WINDOW intervals, weighted by their requests. The
        # requests that finish first after a rise are the short ones: one interval's mean output
        # length is biased short exactly when the pool must grow
        self.lengths: deque[tuple[float, float, float]] = deque(maxlen=LENGTH_WINDOW)
        self.prefill_corr, self.decode_corr = Correction(smoothing), Correction(smoothing)
        self.correct = correct  # off: the factors stay 1, the profiles alone decide
        self.counts = initial
        self.last_change = [now, now]
        self.failures = 0
        self.last_load: Load | None = None

    def _observe(self, obs: Observation) -> None:
        # corrections compare what was seen with what the profile predicts for the same conditions
        load = Load(obs.rate, obs.input_len or 0.0, obs.output_len or 0.0)
        served_p = obs.prefill_servers if obs.prefill_servers is not None else self.counts.prefill
        if self.correct and obs.rate > 0 and obs.input_len and served_p > 0:
            # only a pool below its planned utilisation: above it, the queue's transients (a
            # backlog from a burst) would be read as slow servers
            s = self.prefill_model.ttft(load.input_len) * self.prefill_corr.factor
            if load.rate * s / served_p <= self.limits.max_utilization:
                self.prefill_corr.observe(obs.ttft_s, mean_ttft_lower(self.prefill_model, load, served_p))
        if self.correct and obs.itl_s and obs.decode_batch and obs.input_len and obs.output_len:
            # at the batch the servers ran: their speed, whatever the load did in between
            ctx = decode_context(load)
            self.decode_corr.observe(obs.itl_s, self.decode_model.itl(token_batch(obs.decode_batch), ctx))
        self.rate.observe(obs.rate)
        n = obs.rate * obs.interval_s  # an idle interval says nothing of the lengths
        if n > 0 and obs.input_len and obs.output_len:
            self.lengths.append((n, obs.input_len * n, obs.output_len * n))

    def predicted_load(self) -> Load | None:
        rate = self.rate.predict()
        if rate is None:
            return None
        n = sum(w for w, _, _ in self.lengths)
        if not n:
            return Load(rate, 1.0, 1.0)
        return Load(rate, sum(i for _, i, _ in self.lengths) / n, sum(o for _, _, o in self.lengths) / n)

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
        if obs.prefill_queue:  # the backlog must clear within the next interval, on top of the load
            load = Load(load.rate + obs.prefill_queue / obs.interval_s, load.input_len, load.output_len)
        if obs.decode_batch and obs.decode_servers and obs.itl_s:
            # the sequences in flight, as many as they would be at the ITL the SLO allows
            inflight = obs.decode_batch * obs.decode_servers * min(1.0, self.slo.itl_s / obs.itl_s)
            load = Load(load.rate, load.input_len, load.output_len, decode_inflight=inflight)
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
