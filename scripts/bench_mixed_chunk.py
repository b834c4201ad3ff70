#!/usr/bin/env python
"""Mixed chunked prefill on a colocated server: decode streams while long prompts are prefilled.

Two ``pdserve serve`` runs, one after the other, same chunk size and the same
rows at the same arrival times (``compare_disagg``'s ``mixed`` workload:
decode-heavy streams plus a long prompt every ``--long-period`` seconds):

(a) ``--chunked-prefill-size C``: a long prompt's chunks run back to back and
    every running stream waits for all of them;
(b) the same with ``--enable-mixed-chunk``: each chunk also carries every
    running stream's next token.

Reports the streams' p50/p99 TPOT and the long prompts' TTFT for both, and the
ratios (b) / (a). Ends with one JSON line.

    .venv/bin/python scripts/bench_mixed_chunk.py [--chunk 256] [--rate 1] [--num-prompts 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

import compare_disagg as cd  # noqa: E402
from bench_serving import benchmark  # noqa: E402
from benchlib.client import BACKENDS  # noqa: E402
from benchlib.metrics import calculate_metrics  # noqa: E402


def run_setup(name: str, extra: tuple[str, ...], args, tokenizer, log_dir: str) -> dict:
    server = cd.Colocated(args, log_dir, extra_args=extra, name=name)
    try:
        rows, offsets, kinds = cd.workload("mixed", args.rate, args, tokenizer)
        outputs, duration = asyncio.run(benchmark(server.url, BACKENDS[args.backend](), rows, offsets,
                                                  warmup_requests=2, request_timeout=600.0))
    finally:
        server.stop()
    streams = calculate_metrics([o for o, k in zip(outputs, kinds) if k == "stream"], duration,
                                args.slo_ttft_ms, args.slo_tpot_ms)
    longs = calculate_metrics([o for o, k in zip(outputs, kinds) if k == "long"], duration,
                              args.slo_ttft_ms, args.slo_tpot_ms)
    failed = sum(not o.success for o in outputs)
    m = {
        "setup": name,
        "flags": " ".join(extra),
        "streams_median_tpot_ms": streams["median_tpot_ms"],
        "streams_p99_tpot_ms": streams["p99_tpot_ms"],
        "streams_max_itl_ms": max((max(o.itl) * 1e3 for o, k in zip(outputs, kinds) if k == "stream" and o.itl),
                                  default=None),
        "long_median_ttft_ms": longs["median_ttft_ms"],
        "long_prompts": kinds.count("long"),
        "failed": failed,
    }
    print(f"{name:<8} streams TPOT p50/p99 {m['streams_median_tpot_ms']:.1f}/{m['streams_p99_tpot_ms']:.1f} ms  "
          f"max ITL {m['streams_max_itl_ms']:.0f} ms  long-prompt TTFT p50 {m['long_median_ttft_ms']:.0f} ms  "
          f"failed {failed}", file=sys.stderr, flush=True)
    return m


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size of both runs")
    p.add_argument("--rate", type=float, default=1.0, help="stream arrivals per second")
    p.add_argument("--num-prompts", type=int, default=20, help="streams")
    p.add_argument("--long-input-len", type=int, default=1024)
    p.add_argument("--long-period", type=float, default=3.0)
    a = p.parse_args(argv)
    if a.chunk < 1 or a.rate <= 0 or a.num_prompts < 2:
        p.error("--chunk >= 1, --rate > 0 and --num-prompts >= 2")
    args = cd.parse_args(["--workloads", "mixed", "--num-prompts", str(a.num_prompts), "--long-input-len",
                          str(a.long_input_len), "--long-period", str(a.long_period)])
    args.rate = a.rate
    from pdserve.engine.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model_path)
    chunk = ("--chunked-prefill-size", str(a.chunk))
    with tempfile.TemporaryDirectory(prefix="pdserve-mixed-") as log_dir:
        base = run_setup("chunked", chunk, args, tokenizer, log_dir)
        mixed = run_setup("mixed", chunk + ("--enable-mixed-chunk",), args, tokenizer, log_dir)

    def ratio(key):
        return None if not base[key] or mixed[key] is None else round(mixed[key] / base[key], 3)

    summary = {
        "bench": "mixed_chunk",
        "chunk": a.chunk,
        "rate": a.rate,
        "streams": a.num_prompts,
        "long_input_len": a.long_input_len,
        "results": [base, mixed],
        "streams_p99_tpot_ratio": ratio("streams_p99_tpot_ms"),
        "streams_max_itl_ratio": ratio("streams_max_itl_ms"),
        "long_ttft_ratio": ratio("long_median_ttft_ms"),
    }
    print(json.dumps(summary), flush=True)
    return 0 if not base["failed"] and not mixed["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
