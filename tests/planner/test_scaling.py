"""The scaling rule as a pure function: a table of (load, SLOs, limits, state) -> counts, with the
edges the issue names (no traffic, traffic beyond the budget, a correction factor far from 1)."""

from __future__ import annotations

import math

import pytest

from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel
from pdserve.entrypoints.planner.scaling import (Counts, Limits, Load, Slo, decide, max_prefill_utilization,
                                            planned_batch, predict_itl, predict_ttft)

from planner_synthetic import itl, synthetic_profile, ttft

P, D = PrefillModel(synthetic_profile()), DecodeModel(synthetic_profile())
SLO = Slo(ttft_s=2.0, itl_s=0.1)
LIMITS = Limits(min_prefill=1, max_prefill=8, min_decode=1, max_decode=8, cooldown_s=60)
LIMITS_WIDE = Limits(max_prefill=64, max_decode=64)
LONG_AGO = (1e9, 1e9)
LOAD = Load(rate=2.0, input_len=1000, output_len=200)


def test_moderate_load_by_hand():
    # prefill: s = 0.55 s; the p95 TTFT s + s/(1-rho) ln(rho/0.05) meets 2 s up to rho = 0.309;
    # 2 req/s x 0.55 s / 0.309 = 3.56 -> 4
    s = ttft(1000)
    rho = max_prefill_utilization(s, 2.0, 0.85, 0.95)
    assert 0.30 < rho < 0.31
    assert s + s / (1 - rho) * math.log(rho / 0.05) == pytest.approx(2.0, abs=1e-6)
    # decode: context 1100, itl(b) = 0.02 + 0.012 b; b <= 6 meets 0.1 s. A server's mean batch b
    # solves b = (2 x 200 / n) itl(b + 1) (its tokens see one more, scaling.token_batch). With 9
    # servers b = 3.05; its p95 batch 3.05 + 1.645 sqrt(3.05) = 5.92 steps in 0.091 s: meets.
    # With 8: b = 4, p95 batch 7.29, 0.1075 s: misses. So 9.
    assert D.max_batch(0.1, 1100) == 6
    assert planned_batch(6, 0.95, 0.85) == pytest.approx(3.103, abs=1e-3)
    assert predict_itl(D, LOAD, 8)[1] == pytest.approx(4.0, abs=1e-4)
    assert predict_itl(D, LOAD, 8)[0] == pytest.approx(itl(5, 1100), rel=1e-4)
    b9 = predict_itl(D, LOAD, 9)[1]
    assert b9 == pytest.approx(0.032 * 400 / 9 / (1 - 0.012 * 400 / 9), abs=1e-4)
    assert predict_itl(D, LOAD, 9, quantile=0.95)[0] == pytest.approx(itl(b9 + 1.645 * math.sqrt(b9), 1100), rel=1e-3)
    # low load: one sequence at a time mostly, but a token sees b + 1, not max(b, 1)
    low = predict_itl(D, Load(0.1, 1000, 200), 1)
    assert low[0] == pytest.approx(itl(low[1] + 1, 1100), rel=1e-4) and low[0] > itl(1, 1100)
    d = decide(P, D, LOAD, SLO, LIMITS_WIDE, Counts(1, 1), LONG_AGO)
    assert d.needed == Counts(4, 9) and d.counts == Counts(4, 9) and d.reasons == ()


CASES = [
    # (name, load, limits, current, since_change, corrections, counts, a word of the reasons)
    ("no traffic: the minima", Load(0, 0, 0), LIMITS, Counts(3, 5), LONG_AGO, (1, 1), Counts(1, 1), None),
    ("no traffic, minima 0", Load(0, 0, 0), Limits(min_prefill=0, min_decode=0), Counts(1, 1), LONG_AGO,
     (1, 1), Counts(0, 0), None),
    ("light traffic: one of each", Load(0.2, 200, 50), LIMITS, Counts(1, 1), LONG_AGO, (1, 1), Counts(1, 1),
     None),
    # 5 req/s needs 9 + 21
    ("beyond max: capped", Load(5, 1000, 200), LIMITS, Counts(1, 1), LONG_AGO, (1, 1), Counts(8, 8), "max"),
    ("beyond the budget: shared by need", Load(5, 1000, 200), Limits(budget=6), Counts(1, 1), LONG_AGO,
     (1, 1), Counts(2, 4), "budget"),
    ("budget counts TP size", Load(5, 1000, 200), Limits(budget=10, prefill_cost=2), Counts(1, 1), LONG_AGO,
     (1, 1), Counts(2, 6), "budget"),
    # ITL 3x the profile's: b = 1 meets 0.1/3 s; 2 x 200 x 0.096 = 38.4 sequences, one per server
    ("decode 3x slower than profiled", LOAD, LIMITS_WIDE, Counts(1, 1), LONG_AGO, (1, 3), Counts(4, 39), None),
    ("decode correction beyond max", LOAD, LIMITS, Counts(1, 1), LONG_AGO, (1, 3), Counts(4, 8), "max"),
    ("prefill 4x slower: a prompt alone misses TTFT", LOAD, LIMITS, Counts(1, 1), LONG_AGO, (4, 1),
     Counts(8, 8), "misses"),
    ("prefill 0.25x: fewer servers", Load(4, 1000, 200), LIMITS, Counts(1, 1), LONG_AGO, (0.25, 1),
     Counts(1, 8), "max"),
    ("scale-down waits for the cooldown", Load(0.2, 200, 50), LIMITS, Counts(4, 6), (10, 100), (1, 1),
     Counts(4, 1), "cooldown"),
    ("scale-up never waits", LOAD, LIMITS_WIDE, Counts(1, 1), (0, 0), (1, 1), Counts(4, 9), None),
    ("cooldown holds prefill: decode's rise stays in budget", Load(1, 1000, 200), Limits(budget=6),
     Counts(4, 2), (0, 1e9), (1, 1), Counts(4, 2), "budget"),
    ("sequences in flight beyond the rate's", Load(0.1, 1000, 200, decode_inflight=31), LIMITS_WIDE,
     Counts(1, 1), LONG_AGO, (1, 1), Counts(1, 10), None),
]


@pytest.mark.parametrize("name,load,limits,current,since,corr,want,reason", CASES, ids=[c[0] for c in CASES])
def test_table(name, load, limits, current, since, corr, want, reason):
    d = decide(P, D, load, SLO, limits, current, since, corr)
    assert d.counts == want, (d.counts, d.needed, d.reasons)
    cost = d.counts.prefill * limits.prefill_cost + d.counts.decode * limits.decode_cost
    assert cost <= limits.budget
    if reason is None:
        assert d.reasons == ()
    else:
        assert any(reason in r for r in d.reasons), d.reasons


def test_decode_correction_by_hand():
    # correction 3: b must meet 0.1/3 s: 0.02 + 0.012 b <= 0.0333 -> b = 1, itl 3 x 0.032 = 0.096
    # 2 x 200 x 0.096 / (1 x 0.85) = 45.2 -> 46
    assert D.max_batch(0.1 / 3, 1100) == 1
    assert math.ceil(2 * 200 * 3 * itl(1, 1100) / 0.85) == 46


def test_predictions_meet_the_slo_at_the_counts_decided():
    for rate in (0.5, 1, 2, 3):
        load = Load(rate, 1000, 200)
        d = decide(P, D, load, SLO, LIMITS_WIDE, Counts(1, 1), LONG_AGO)
        assert predict_ttft(P, load, d.counts.prefill, quantile=0.95) <= SLO.ttft_s + 1e-9
        assert predict_itl(D, load, d.counts.decode)[0] <= SLO.itl_s
        # one prefill server fewer misses the p95 TTFT
        if d.counts.prefill > 1:
            assert predict_ttft(P, load, d.counts.prefill - 1, quantile=0.95) > SLO.ttft_s


def test_limits_validate():
    with pytest.raises(ValueError, match="budget"):
        Limits(min_prefill=2, min_decode=2, budget=3)
    with pytest.raises(ValueError, match="min <= max"):
        Limits(min_decode=3, max_decode=2)
