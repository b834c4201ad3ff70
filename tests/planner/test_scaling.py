"""The scaling rule as a pure function: a table of (load, SLOs, limits, state) -> counts, with the
edges the issue names (no traffic, traffic beyond the budget, a correction factor far from 1)."""

from __future__ import annotations

import math

import pytest

from pdserve.engine.planner.perf_model import DecodeModel, PrefillModel
from pdserve.engine.planner.scaling import (Counts, Limits, Load, Slo, decide, max_prefill_utilization,
                                            predict_itl, predict_ttft)

from planner_synthetic import itl, synthetic_profile, ttft

P, D = PrefillModel(synthetic_profile()), DecodeModel(synthetic_profile())
SLO = Slo(ttft_s=2.0, itl_s=0.1)
LIMITS = Limits(min_prefill=1, max_prefill=8, min_decode=1, max_decode=8, cooldown_s=60)
LONG_AGO = (1e9, 1e9)
LOAD = Load(rate=2.0, input_len=1000, output_len=200)


def test_moderate_load_by_hand():
    # prefill: s = 0.55 s; x = 2/0.55; rho = 2(x-1)/(2x-1) = 0.8405; 2 x 0.55 / 0.8405 = 1.31 -> 2
    s = ttft(1000)
    assert max_prefill_utilization(s, 2.0, 0.85) == pytest.approx(2 * (2 / s - 1) / (4 / s - 1))
    # decode: context 1100, itl(b) = 0.02 + 0.012 b; b <= 6 meets 0.1 s (itl 0.092);
    # 2 req/s x 200 tokens x 0.092 s / (6 x 0.85) = 7.2 -> 8
    assert D.max_batch(0.1, 1100) == 6
    d = decide(P, D, LOAD, SLO, LIMITS, Counts(1, 1), LONG_AGO)
    assert d.needed == Counts(2, 8) and d.counts == Counts(2, 8) and d.reasons == ()


CASES = [
    # (name, load, limits, current, since_change, corrections, counts, a word of the reasons)
    ("no traffic: the minima", Load(0, 0, 0), LIMITS, Counts(3, 5), LONG_AGO, (1, 1), Counts(1, 1), None),
    ("no traffic, minima 0", Load(0, 0, 0), Limits(min_prefill=0, min_decode=0), Counts(1, 1), LONG_AGO,
     (1, 1), Counts(0, 0), None),
    ("light traffic: one of each", Load(0.2, 200, 50), LIMITS, Counts(1, 1), LONG_AGO, (1, 1), Counts(1, 1),
     None),
    ("beyond max: capped", Load(5, 1000, 200), LIMITS, Counts(1, 1), LONG_AGO, (1, 1), Counts(4, 8), "max"),
    ("beyond the budget: shared by need", Load(5, 1000, 200), Limits(budget=6), Counts(1, 1), LONG_AGO,
     (1, 1), Counts(2, 4), "budget"),
    ("budget counts TP size", Load(5, 1000, 200), Limits(budget=10, prefill_cost=2), Counts(1, 1), LONG_AGO,
     (1, 1), Counts(3, 4), "budget"),  # 4+8 wanted: shares grown 1:2
    ("decode 3x slower than profiled", LOAD, Limits(max_decode=64), Counts(1, 1), LONG_AGO, (1, 3),
     Counts(2, 46), None),
    ("decode correction beyond max", LOAD, LIMITS, Counts(1, 1), LONG_AGO, (1, 3), Counts(2, 8), "max"),
    ("prefill 4x slower: a prompt alone misses TTFT", LOAD, LIMITS, Counts(1, 1), LONG_AGO, (4, 1),
     Counts(8, 8), "misses"),
    ("prefill 0.25x: fewer servers", Load(4, 1000, 200), LIMITS, Counts(1, 1), LONG_AGO, (0.25, 1),
     Counts(1, 8), "max"),
    ("scale-down waits for the cooldown", Load(0.2, 200, 50), LIMITS, Counts(4, 6), (10, 100), (1, 1),
     Counts(4, 1), "cooldown"),
    ("scale-up never waits", LOAD, LIMITS, Counts(1, 1), (0, 0), (1, 1), Counts(2, 8), None),
    ("cooldown holds prefill: decode's rise stays in budget", Load(1, 1000, 200), Limits(budget=6),
     Counts(4, 2), (0, 1e9), (1, 1), Counts(4, 2), "budget"),
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
        d = decide(P, D, load, SLO, Limits(max_prefill=64, max_decode=64), Counts(1, 1), LONG_AGO)
        assert predict_ttft(P, load, d.counts.prefill) <= SLO.ttft_s
        assert predict_itl(D, load, d.counts.decode)[0] <= SLO.itl_s
        # one server fewer of a role would miss its SLO or exceed the planned utilisation
        if d.counts.prefill > 1:
            s = ttft(1000)
            assert rate * s / (d.counts.prefill - 1) > max_prefill_utilization(s, SLO.ttft_s, 0.85) - 1e-9


def test_limits_validate():
    with pytest.raises(ValueError, match="budget"):
        Limits(min_prefill=2, min_decode=2, budget=3)
    with pytest.raises(ValueError, match="min <= max"):
        Limits(min_decode=3, max_decode=2)
