#!/usr/bin/env python
"""The offline Engine's decode speed in a busy process against a fresh one.

Each side runs in a process of its own, one after the other, with the same flags: ``fresh`` makes
an Engine first thing; ``busy`` first runs twenty 512x512 matrix products on its main thread (a
notebook, a script that preprocessed), so the process has an OpenMP pool before the Engine starts;
``busy_thread`` does the same with ``Engine(rank_on_thread=True)`` (the rank on a thread of that
process: two OpenMP pools), to show what the rank's own process avoids. Figure: one sequence's
greedy decode of ``--new-tokens`` tokens (ignore_eos), best of ``--repeats``, in tokens/s. Ends with
one JSON line with each side's figure and the ratios to ``fresh``.

    .venv/bin/python scripts/bench_engine_busy.py                 # bf16, 128 tokens, best of 3
    .venv/bin/python scripts/bench_engine_busy.py --rounds 2      # the sides twice, interleaved
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SIDE = r"""
import json, sys, time
import torch
side, dtype, new_tokens, repeats, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if side.startswith("busy"):
    a = torch.randn(512, 512)
    for _ in range(20):
        a = (a @ a).tanh()
from pdserve.engine import Engine
t0 = time.perf_counter()
kw = {"num_threads": threads} if threads else {}
engine = Engine(dtype=dtype, max_total_tokens=4096, rank_on_thread=side == "busy_thread", **kw)
start_s = time.perf_counter() - t0
sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
engine.generate(input_ids=[1] * 16, sampling_params={**sp, "max_new_tokens": 8})  # warm-up
best = 0.0
for _ in range(repeats):
    t = time.perf_counter()
    engine.generate(input_ids=[1] * 16, sampling_params=sp)
    best = max(best, new_tokens / (time.perf_counter() - t))
engine.shutdown()
print(json.dumps({"side": side, "tok_s": round(best, 2), "start_s": round(start_s, 1)}))
"""

SIDES = ("fresh", "busy", "busy_thread")


def run_side(side: str, args) -> dict:
    out = subprocess.run([sys.executable, "-c", SIDE, side, args.dtype, str(args.new_tokens), str(args.repeats),
                          str(args.threads)], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"side {side} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="the Engine's num_threads; 0: torch's default")
    p.add_argument("--rounds", type=int, default=1, help="run the sides this many times, interleaved; best kept")
    args = p.parse_args()
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for side in SIDES:
            r = run_side(side, args)
            print(json.dumps(r), flush=True)
            if side not in best or r["tok_s"] > best[side]["tok_s"]:
                best[side] = r
    fresh = best["fresh"]["tok_s"]
    summary = {"dtype": args.dtype, "new_tokens": args.new_tokens, "repeats": args.repeats, "rounds": args.rounds,
               **{f"{s}_tok_s": best[s]["tok_s"] for s in SIDES},
               **{f"{s}_start_s": best[s]["start_s"] for s in SIDES},
               "busy_vs_fresh": round(best["busy"]["tok_s"] / fresh, 3),
               "busy_thread_vs_fresh": round(best["busy_thread"]["tok_s"] / fresh, 3)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
