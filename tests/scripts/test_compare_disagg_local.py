"""scripts/compare_disagg.py's interference workload and its three-setup table, without servers."""

from __future__ import annotations

import os
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import compare_disagg as cd  # noqa: E402


def test_interference_has_short_chats_and_a_long_prompt_every_period():
    from pdserve.engine.text.tokenizer import load_tokenizer

    args = cd.parse_args(["--num-prompts", "30", "--interference-period", "2"])
    rows, offsets, kinds = cd.workload("interference", 3.0, args, load_tokenizer(None))
    shorts = [r for r, k in zip(rows, kinds) if k == "short"]
    longs = [(r, t) for r, t, k in zip(rows, offsets, kinds) if k == "long"]
    assert offsets == sorted(offsets) and len(shorts) == 30 and len(longs) >= 3
    assert all(r.prompt_len == 64 and r.output_len == 32 for r in shorts)
    assert all(1500 <= r.prompt_len <= 2000 and r.output_len == 8 for r, _ in longs)
    assert [t for _, t in longs] == [2.0 * (k + 0.5) for k in range(len(longs))]


def run(rate, short_ttft, goodput):
    return {"rate": rate, "median_ttft_ms": short_ttft, "p99_ttft_ms": 2 * short_ttft, "median_tpot_ms": 20.0,
            "p99_tpot_ms": 40.0, "short_median_ttft_ms": short_ttft, "short_p99_tpot_ms": 30.0,
            "request_throughput": rate, "output_throughput": 10 * rate, "goodput": goodput}


def test_interference_compares_at_the_rate_where_1p1d_short_ttft_doubled():
    results = {"colocated": {"interference": [run(1, 100, 1.0), run(2, 150, 1.0), run(3, 300, 1.0)]},
               "1p1d": {"interference": [run(1, 200, 1.0), run(2, 350, 1.5), run(3, 500, 1.5)]},
               "1p1d+local": {"interference": [run(1, 150, 1.0), run(2, 200, 1.8), run(3, 250, 2.0)]}}
    assert cd.comparison_rate(results, "interference", 100.0) == 3  # 500 >= 2 x 200; 350 is not
    # measured idle TTFT (one request at a time) is the baseline when there is one: 350 >= 2 x 150,
    # and a setup already saturated at the lowest rate compares there
    assert cd.comparison_rate(results, "interference", 100.0, {"1p1d": {"short_ttft_ms": 150.0}}) == 2
    assert cd.comparison_rate(results, "interference", 100.0, {"1p1d": {"short_ttft_ms": 90.0}}) == 1
    table, ratios = cd.ratio_table(results, "interference", 3)
    assert ratios["local/1p1d"]["short_median_ttft_ms"] == pytest.approx(0.5)
    assert ratios["local/col"]["goodput"] == pytest.approx(2.0)
    assert ratios["goodput"] == pytest.approx(1.5)  # 1p1d/col, flat
    assert "local/1p1d" in table and "short p50 TTFT ms" in table
    del results["colocated"]  # a subset of setups: only the ratio it can give
    _, ratios = cd.ratio_table(results, "interference", 3)
    assert set(ratios) == {"local/1p1d"}


def test_kv_routing_ideal_hit_rate_is_every_group_on_one_worker():
    import bench_kv_routing as kr

    args = kr.build_parser().parse_args(["--sp-prompts-per-group", "4", "--sp-system-prompt-len", "100",
                                         "--sp-question-len", "28"])
    # 3 of 4 prompts find the system prompt's 6 full pages (96 tokens); each prompt is 128 tokens
    assert kr.ideal_hit_rate(args) == pytest.approx(3 * 96 / (4 * 128))
