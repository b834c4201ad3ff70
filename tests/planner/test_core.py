"""The planner's pure parts: profile JSON and its mismatch check, interpolation, predictors,
corrections, and the planner's state across intervals (holding on a bad scrape)."""

from __future__ import annotations

import math

import pytest

from pdserve.entrypoints.planner import profile as prof
from pdserve.entrypoints.planner.correction import MAX_FACTOR, Correction
from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel
from pdserve.entrypoints.planner.predictor import make_predictor
from pdserve.entrypoints.planner.scaling import Counts, Limits, Slo
from pdserve.entrypoints.planner.sla_planner import Observation, SlaPlanner

from planner_synthetic import SERVER, itl, synthetic_profile, ttft


def test_profile_round_trip_and_mismatch(tmp_path):
    p = prof.new_profile(SERVER, synthetic_profile().prefill, synthetic_profile().decode, note="t")
    path = str(tmp_path / "p.json")
    prof.save(p, path)
    back = prof.load(path)
    assert back == p and back.machine.cores >= 1 and back.machine.cpu
    prof.check_matches(back, SERVER)
    other = prof.ServerDescription(model="synthetic", dtype="float32", tp_size=2)
    with pytest.raises(prof.ProfileMismatch, match=r"dtype: 'bfloat16' != 'float32'; tp_size: 1 != 2"):
        prof.check_matches(back, other)
    (tmp_path / "bad.json").write_text('{"version": 1, "prefill": []}')
    with pytest.raises(ValueError, match="bad.json: not a pdserve profile"):
        prof.load(str(tmp_path / "bad.json"))


def test_interpolation():
    pm, dm = PrefillModel(synthetic_profile()), DecodeModel(synthetic_profile())
    assert pm.ttft(640) == pytest.approx(ttft(640))  # between points: exact for a linear truth
    assert pm.ttft(8192) == pytest.approx(ttft(8192))  # past the end: the last segment's slope
    assert dm.itl(8, 512) == pytest.approx(itl(8, 512))  # bilinear over (batch, context)
    assert dm.itl(128, 4096) == pytest.approx(itl(128, 4096))
    assert dm.max_batch(itl(10, 1024) + 1e-9, 1024) == 10


def test_decode_curve_never_falls_with_batch():
    p = synthetic_profile()
    noisy = tuple(prof.DecodePoint(d.batch_size, d.context_len, d.itl_s * (0.3 if d.batch_size == 16 else 1))
                  for d in p.decode)
    dm = DecodeModel(prof.Profile(machine=p.machine, server=p.server, prefill=p.prefill, decode=noisy))
    assert dm.itl(16, 256) == pytest.approx(itl(4, 256))  # the dip is lifted to the smaller batch's


def test_predictors():
    seq = [1.0, 1.0, 10.0, 1.0]
    c, ma, pk = (make_predictor(n, window=3) for n in ("constant", "moving_average", "peak"))
    assert c.predict() is None
    for v in seq:
        for pr in (c, ma, pk):
            pr.observe(v)
    assert c.predict() == 1.0 and ma.predict() == pytest.approx(4.0) and pk.predict() == 10.0
    with pytest.raises(ValueError, match="predictor must be one of"):
        make_predictor("arima")


def test_correction_smooths_and_clamps():
    c = Correction(smoothing=0.5)
    assert c.observe(2.0, 1.0) == pytest.approx(math.sqrt(2))
    assert c.observe(None, 1.0) == pytest.approx(math.sqrt(2))  # nothing measured: unchanged
    for _ in range(50):
        c.observe(100.0, 1.0)
    assert c.factor == pytest.approx(MAX_FACTOR)


def _planner() -> SlaPlanner:
    return SlaPlanner(synthetic_profile(), synthetic_profile(), Slo(2.0, 0.1),
                      Limits(max_prefill=16, max_decode=16, cooldown_s=30), Counts(1, 1), predictor="constant")


def test_planner_follows_the_load_and_holds_on_bad_scrapes():
    pl = _planner()
    obs = Observation(interval_s=10, rate=2.0, input_len=1000, output_len=200, ttft_s=None, itl_s=None)
    s = pl.step(10, obs)
    assert s.decision.counts == Counts(4, 9) and not s.held  # (test_scaling's by-hand case)
    for bad in (None, Observation(interval_s=10, rate=-1.0), Observation(interval_s=10, rate=float("nan")),
                Observation(interval_s=10, rate=1e9)):
        s = pl.step(20, bad)
        assert s.held and s.decision.counts == Counts(4, 9)
    assert pl.failures == 4
    # load gone: decode waits out its cooldown (last change at t=10), then falls to the minimum
    quiet = Observation(interval_s=10, rate=0.0)
    assert pl.step(30, quiet).decision.counts == Counts(4, 9)
    assert pl.step(40, quiet).decision.counts == Counts(1, 1)


def test_planner_corrects_by_what_it_sees():
    pl = _planner()
    pl.step(10, Observation(interval_s=10, rate=2.0, input_len=1000, output_len=200))
    # the decode servers ran 6 sequences each of context 1000 + 200/2 (their tokens see 7,
    # scaling.token_batch), 3x slower than profiled
    s = pl.step(20, Observation(interval_s=10, rate=2.0, input_len=1000, output_len=200, itl_s=3 * itl(7, 1100),
                                decode_batch=6, decode_servers=12))
    assert s.corrections[1] == pytest.approx(math.sqrt(3))
    assert s.decision.counts.decode == 16  # more than 9: capped at max
    # a prefill pool far beyond its planned utilisation teaches nothing (a burst's backlog)
    s = pl.step(30, Observation(interval_s=10, rate=20.0, input_len=1000, output_len=200, ttft_s=60.0,
                                prefill_servers=1))
    assert s.corrections[0] == 1.0
    # ... one below it does: prompts alone took twice the profile's time
    s = pl.step(40, Observation(interval_s=10, rate=0.01, input_len=1000, output_len=200, ttft_s=2 * ttft(1000),
                                prefill_servers=4))
    assert s.corrections[0] == pytest.approx(math.sqrt(2), rel=0.01)


def test_no_correction_plans_by_the_profile_alone():
    pl = SlaPlanner(synthetic_profile(), synthetic_profile(), Slo(2.0, 0.1),
                    Limits(max_prefill=16, max_decode=16, cooldown_s=30), Counts(1, 1), predictor="constant",
                    correct=False)
    pl.step(10, Observation(interval_s=10, rate=2.0, input_len=1000, output_len=200))
    s = pl.step(20, Observation(interval_s=10, rate=2.0, input_len=1000, output_len=200, itl_s=3 * itl(7, 1100),
                                decode_batch=6, decode_servers=12, ttft_s=60.0, prefill_servers=4))
    assert s.corrections == (1.0, 1.0)
    assert s.decision.counts == Counts(4, 9)  # the uncorrected plan of the same load


def test_prefill_backlog_adds_to_the_load():
    pl = _planner()
    quiet = pl.step(10, Observation(interval_s=10, rate=0.2, input_len=1000, output_len=200))
    backlog = pl.step(20, Observation(interval_s=10, rate=0.2, input_len=1000, output_len=200, prefill_queue=20))
    assert backlog.predicted.rate == pytest.approx(0.2 + 20 / 10)
    assert backlog.decision.counts.prefill > quiet.decision.counts.prefill
