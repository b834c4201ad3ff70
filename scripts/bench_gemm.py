#!/usr/bin/env python
"""The native panel products (``kernels/cpu_gemm.c``) against oneDNN's prepacked linears, in one run.

For each row count, the default model's five product shapes (q|k|v, o, gate|up, down, the LM
head), each with as many distinct weight matrices as the model has (30 layers, one head), all
called in turn with a 512 MB read in between: the weights come from memory, as in a step, not
from cache. Both sides take turns within each repeat (best of ``--repeats``). Reports each
shape's GFLOP/s on both sides and the whole step's products' time and ratio; the bf16 GEMM peak
(a 4096^3 product) is measured in the same run. Ends with one JSON line.

    .venv/bin/python scripts/bench_gemm.py [--threads 2] [--rows 16 64 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

from benchlib.hw_limits import gemm_rate  # noqa: E402

from pdserve.kernels.cpu_native import native_kernels  # noqa: E402
from pdserve.kernels.gemm_layout import PanelWeight  # noqa: E402

# the default model's (SmolLM2-135M) products: (name, N, K, matrices per step)
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("lm_head", 49152, 576, 1)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = native_kernels()
    if native is None or not native.has_gemm:
        sys.exit("the native panel products need AVX-512 BF16 (without AMX) and a C compiler")
    lp = torch.ops.mkldnn._linear_pointwise
    flush = torch.ones(256 * 1024 * 1024, dtype=torch.bfloat16)  # 512 MB
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, n, k, count in SHAPES:
        dense = [(torch.randn(n, k, generator=g) / k**0.5).bfloat16() for _ in range(count)]
        weights[name] = ([torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in dense],
                         [PanelWeight.pack(w) for w in dense])
    result: dict = {"bench": "gemm", "threads": args.threads, "gemm_peak_gflops": round(gemm_rate(), 1)}
    for rows in args.rows:
        step = {"onednn": 0.0, "native": 0.0}
        for name, n, k, count in SHAPES:
            x = torch.randn(rows, k, generator=g).bfloat16()
            onednn, panels = weights[name]
            runs = {"onednn": lambda: [lp(x, w, None, "none", [], "") for w in onednn],
                    "native": lambda: [native.gemm(x, w) for w in panels]}
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.repeats):
                for side, run in runs.items():
                    flush.sum()
                    t = time.perf_counter()
                    run()
                    best[side] = min(best[side], time.perf_counter() - t)
            flops = 2 * rows * n * k * count
            for side in runs:
                step[side] += best[side]
                result[f"{side}_{name}_m{rows}_gflops"] = round(flops / best[side] / 1e9, 1)
            print(f"rows {rows:5d} {name:8s} x{count}: oneDNN {flops / best['onednn'] / 1e9:6.0f} GFLOP/s, "
                  f"native {flops / best['native'] / 1e9:6.0f} GFLOP/s", file=sys.stderr)
        result[f"onednn_step_m{rows}_ms"] = round(step["onednn"] * 1e3, 2)
        result[f"native_step_m{rows}_ms"] = round(step["native"] * 1e3, 2)
        result[f"native_vs_onednn_m{rows}"] = round(step["onednn"] / step["native"], 3)
        print(f"rows {rows:5d} step's products: oneDNN {step['onednn'] * 1e3:.1f} ms, native "
              f"{step['native'] * 1e3:.1f} ms, {step['onednn'] / step['native']:.2f}x", file=sys.stderr)
    result["load_avg"] = round(os.getloadavg()[0], 1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
