#!/usr/bin/env python
"""The fused CPU expert kernel (``kernels/cpu_moe.c``) against the same experts in torch ops
(``fused_experts_torch``: a gather and three oneDNN products per expert that received tokens) and,
with ``--per-expert``, against the layers' per-expert method (``PerExpertMoEMethod``: each expert's
matrices through the engine's linear methods, gemv at small steps; ~2x more memory), in one run,
on one mixture-of-experts layer of Qwen3-30B-A3B's shape by default (hidden 2048, 128 experts of
768 intermediate rows, top 8; bf16 weights 1.2 GB, so they come from memory).

Routing is random (uniform top-k per token, seeded). For each step size both sides take turns
within each repeat (best of ``--repeats``). Ends with one JSON line: per step size the two times
in ms and the ratios (baseline / fused).

    .venv/bin/python scripts/bench_moe.py [--threads 2] [--rows 1 4 16 64 256] [--experts 128] [--per-expert]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve.engine.model_executor.layers import KernelPlan, PerExpertMoEMethod, Step, can_prepack
from pdserve.engine.model_executor.model_runner import cpu_supports_bf16
from pdserve.kernels.cpu_moe import MoeKernels, fused_experts_torch
from pdserve.kernels.cpu_native import native_kernels


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-expert", action="store_true", help="also time the layers' per-expert method")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = native_kernels()
    if native is None:
        raise SystemExit("no native kernels (no C compiler)")
    kernels = MoeKernels(native)
    g = torch.Generator().manual_seed(0)
    E, H, inter = args.experts, args.hidden, args.inter
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).bfloat16()
    sides = {"fused": kernels.experts, "torch": fused_experts_torch}
    if args.per_expert:
        cpu = torch.device("cpu")
        plan = KernelPlan.choose(torch.bfloat16, cpu, prepack=can_prepack(torch.bfloat16, cpu, cpu_supports_bf16()))
        per_expert = PerExpertMoEMethod(plan, E)
        per_expert.prepare(w13, w2)
        sides["per_expert"] = lambda x, w13, w2, ids, weights: per_expert.apply(x, weights, ids,
                                                                                Step(x.shape[0], True))
    results = {}
    for rows in args.rows:
        x = torch.randn(rows, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[: args.top_k] for _ in range(rows)])  # [T, k]
        weights = torch.rand(rows, args.top_k, generator=g).softmax(-1)
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.repeats):
            for name, fn in sides.items():
                t0 = time.perf_counter()
                fn(x, w13, w2, ids, weights)
                best[name] = min(best[name], time.perf_counter() - t0)
        results[rows] = {f"{name}_ms": round(t * 1e3, 3) for name, t in best.items()}
        results[rows].update({f"{name}_ratio": round(t / best["fused"], 2) for name, t in best.items() if name != "fused"})
        print(f"rows {rows:4d}: " + "  ".join(f"{name} {t * 1e3:8.2f} ms" for name, t in best.items())
              + f"  ({kernels.isa}, {args.threads} threads)", flush=True)
    summary = {"bench": "moe_experts", "isa": kernels.isa, "threads": args.threads, "experts": E, "top_k": args.top_k,
               "hidden": H, "inter": inter, "results": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
