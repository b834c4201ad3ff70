"""The trace generator and the simulator with the planner in the loop (virtual connector)."""

from __future__ import annotations

import pytest

from pdserve.entrypoints.planner.scaling import Counts, Limits, Slo
from pdserve.entrypoints.planner.simulator import SimConfig, simulate
from pdserve.entrypoints.planner.sla_planner import SlaPlanner
from pdserve.entrypoints.planner.trace import Request, TraceShape, daily_trace, rate_at, read_csv, write_csv

from planner_synthetic import synthetic_profile

SHAPE = TraceShape(duration_s=900, peak_rate=3.0, seed=1)


def test_trace_is_seeded_and_shaped(tmp_path):
    a, b = daily_trace(SHAPE), daily_trace(SHAPE)
    assert a == b and a != daily_trace(TraceShape(duration_s=900, peak_rate=3.0, seed=2))
    # the night trough, the afternoon peak, the burst and the quiet period, in arrivals per window

    def count(u0, u1):
        return sum(1 for r in a if u0 * 900 <= r.arrival_s < u1 * 900) / ((u1 - u0) * 900)
    assert count(2 / 24, 6 / 24) < 0.6 < 2.0 < count(14 / 24, 18 / 24)
    no_burst = TraceShape(duration_s=900, peak_rate=3.0, burst_factor=1.0)
    assert rate_at(SHAPE, 10.2 / 24 * 900) == pytest.approx(2.5 * rate_at(no_burst, 10.2 / 24 * 900))
    assert count(SHAPE.quiet_start, SHAPE.quiet_start + SHAPE.quiet_length) < 0.3
    path = str(tmp_path / "t.csv")
    write_csv(a, path)
    back = read_csv(path)
    assert [(r.input_len, r.output_len) for r in back] == [(r.input_len, r.output_len) for r in a]
    (tmp_path / "bad.csv").write_text("arrival_s,input_len,output_len\n1.0,12,x\n")
    with pytest.raises(ValueError, match="bad.csv:2"):
        read_csv(str(tmp_path / "bad.csv"))


def test_planner_in_the_loop_scales_up_and_down():
    trace = daily_trace(SHAPE)
    prof = synthetic_profile()
    cfg = SimConfig(slo=Slo(2.0, 0.1), interval_s=10, startup_s=10)
    planner = SlaPlanner(prof, prof, cfg.slo, Limits(max_prefill=16, max_decode=32, cooldown_s=30),
                         Counts(1, 1), predictor="peak", window=4)
    r = simulate(trace, prof, prof, cfg, planner=planner)
    peak_d = max(s.decode for s in r.samples)
    assert peak_d >= 4 and r.samples[-1].decode < peak_d  # grew for the peak, shrank after it
    assert r.decisions == len(r.samples)
    big = simulate(trace, prof, prof, cfg, static=Counts(4, peak_d))
    small = simulate(trace, prof, prof, cfg, static=Counts(1, 1))
    assert big.attainment > 0.98 and small.attainment < 0.5
    assert r.attainment > 0.9 and r.server_seconds < 0.7 * big.server_seconds
    with pytest.raises(ValueError, match="not both"):
        simulate(trace, prof, prof, cfg)


def test_one_request_by_hand():
    prof = synthetic_profile()
    cfg = SimConfig(slo=Slo(1.0, 0.05), interval_s=5)
    r = simulate([Request(0.0, 1024, 11)], prof, prof, cfg, static=Counts(1, 1))
    # TTFT = the profile's 0.562 s; then 10 steps of one sequence at context 1024..1033
    assert r.ttft_attainment == 1.0 and r.itl_attainment == 1.0
    assert r.server_seconds == pytest.approx(2 * 5.0)  # two servers until the first tick
