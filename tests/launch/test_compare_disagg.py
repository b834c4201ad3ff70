"""scripts/compare_disagg.py without servers: its workloads, its comparison rate and ratio table,
its argument checks (the full run is a benchmark, run by hand: see the README)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import compare_disagg as cd  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.engine.text.tokenizer import load_tokenizer

    return load_tokenizer(None)


def test_mixed_workload_interleaves_periodic_long_prompts(tokenizer):
    args = cd.parse_args(["--quick", "--num-prompts", "20", "--long-period", "2"])
    rows, offsets, kinds = cd.workload("mixed", 2.0, args, tokenizer)
    assert offsets == sorted(offsets)
    longs = [(r, t) for r, t, k in zip(rows, offsets, kinds) if k == "long"]
    streams = [r for r, k in zip(rows, kinds) if k == "stream"]
    assert len(streams) == 20 and len(longs) >= 1
    assert all(r.prompt_len == args.long_input_len and r.output_len == 2 for r, _ in longs)
    assert [t for _, t in longs] == [2.0 * (k + 0.5) for k in range(len(longs))]
    assert all(r.prompt_len == args.stream_input_len and r.output_len == args.stream_output_len for r in streams)
    again = cd.workload("mixed", 2.0, args, tokenizer)  # fixed seeds: the same rows for both setups
    assert [r.prompt_ids for r in again[0]] == [r.prompt_ids for r in rows] and again[1] == offsets


def test_comparison_rate_is_where_colocated_first_misses_the_tpot_slo():
    def run(rate, tpot, goodput):
        return {"rate": rate, "p99_tpot_ms": tpot, "streams_p99_tpot_ms": tpot, "goodput": goodput,
                "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "median_tpot_ms": tpot / 2,
                "request_throughput": rate, "output_throughput": 10 * rate}

    results = {"colocated": {"mixed": [run(0.5, 50, 0.5), run(1, 150, 0.4), run(2, 400, 0.1)]},
               "1p1d": {"mixed": [run(0.5, 40, 0.5), run(1, 60, 0.9), run(2, 90, 1.8)]}}
    assert cd.comparison_rate(results, "mixed", 100.0) == 1
    assert cd.comparison_rate(results, "mixed", 1000.0) == 2  # never missed: the highest rate
    table, ratios = cd.ratio_table(results, "mixed", 1)
    assert ratios["p99_tpot_ms"] == pytest.approx(0.4) and ratios["goodput"] == pytest.approx(2.25)
    assert "1p1d/col" in table


@pytest.mark.parametrize("argv, message", [
    (["--rates", "0"], "--rates must be finite and > 0"),
    (["--num-prompts", "1"], "--num-prompts must be >= 2"),
    (["--model-path", "/no/such/model"], "no such file or directory"),
])
def test_bad_arguments(argv, message):
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "compare_disagg.py"), *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
