#!/usr/bin/env python
"""w8a8's linears of a prefill against bf16's, in one run: one layer of the default model at
``--rows`` tokens, each linear with its epilogue (q|k|v plain, o and down plus the residual,
gate|up as SwiGLU).

Sides, taking turns within each repeat (best of ``--repeats``):
- ``bf16``: oneDNN's prepacked linears with their post-ops, the bf16 model's large steps
  where the CPU has AMX or lacks the native panel products (``KernelPlan.packed``);
- ``int_mm``: w8a8 through ``torch._int_mm`` between the native quantizing and scaling passes
  (``quantization.int8_linear`` over the transposed int8 weights);
- ``amx``: w8a8 through ``cpu_amx_int8.c`` (quantizing, then product and scaling in one call),
  where the CPU has AMX-INT8.

Each side's time includes quantizing its activations. Reports each shape's time per side, the
layer's sum and the ratios to bf16. Ends with one JSON line.

    .venv/bin/python scripts/bench_int8_products.py [--threads 2] [--rows 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from pdserve.engine.model_executor.quantization import Int8Weight, int8_linear
from pdserve.kernels.amx_layout import AmxInt8Weight
from pdserve.kernels.cpu_int8_act import Int8ActKernels
from pdserve.kernels.cpu_native import native_kernels

# the default model's (SmolLM2-135M) linears of one layer: (name, N, K, epilogue)
SHAPES = [("qkv", 960, 576, "plain"), ("o", 576, 576, "residual"), ("gate_up", 3072, 576, "swiglu"),
          ("down", 576, 1536, "residual")]


def sides_for(n: int, k: int, epilogue: str, rows: int, act: Int8ActKernels, g: torch.Generator) -> dict:
    """Each side's call for one shape, on the same bf16 weights and activations (oneDNN's weights
    prepacked as the model prepacks them, for 64 rows)."""
    lp = torch.ops.mkldnn._linear_pointwise
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    res = torch.randn(rows, n, generator=g).bfloat16() if epilogue == "residual" else None
    swiglu = epilogue == "swiglu"
    q = Int8Weight.quantize(w)
    if swiglu:
        gate, up = (torch.ops.mkldnn._reorder_linear_weight(part.contiguous(), 64) for part in w.chunk(2))
        sides = {"bf16": lambda: lp.binary(x, lp(x, gate, None, "swish", [], ""), up, None, "mul")}
    else:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        sides = {"bf16": (lambda: lp.binary(x, res, packed, None, "add")) if res is not None
                 else (lambda: lp(x, packed, None, "none", [], ""))}
    wt = q.transposed()
    sides["int_mm"] = lambda: int8_linear(x, wt, act, res, swiglu)
    if act.has_amx:
        amx = AmxInt8Weight.pack(q.q, q.scale, swiglu)
        sides["amx"] = lambda: int8_linear(x, amx, act, res, swiglu)
    return sides


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = native_kernels()
    if native is None:
        sys.exit("w8a8's native passes need a C compiler")
    act = Int8ActKernels(native)
    g = torch.Generator().manual_seed(0)
    result: dict = {"bench": "int8_products", "threads": args.threads, "rows": args.rows, "amx": act.has_amx}
    total: dict[str, float] = {}
    for name, n, k, epilogue in SHAPES:
        sides = sides_for(n, k, epilogue, args.rows, act, g)
        best = dict.fromkeys(sides, float("inf"))
        for run in sides.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for side, run in sides.items():
                t = time.perf_counter()
                run()
                best[side] = min(best[side], time.perf_counter() - t)
        for side, t in best.items():
            total[side] = total.get(side, 0.0) + t
            result[f"{side}_{name}_ms"] = round(t * 1e3, 3)
        print(f"{name:8s} {args.rows} x {k} x {n} ({epilogue}): "
              + ", ".join(f"{side} {t * 1e3:.2f} ms" for side, t in best.items()), file=sys.stderr)
    for side, t in total.items():
        result[f"{side}_layer_ms"] = round(t * 1e3, 3)
        if side != "bf16":
            result[f"{side}_vs_bf16"] = round(total["bf16"] / t, 3)
    print("layer: " + ", ".join(f"{side} {t * 1e3:.2f} ms" for side, t in total.items()) + "; "
          + ", ".join(f"{side} {total['bf16'] / t:.2f}x bf16" for side, t in total.items() if side != "bf16"),
          file=sys.stderr)
    result["load_avg"] = round(os.getloadavg()[0], 1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
