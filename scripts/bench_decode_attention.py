#!/usr/bin/env python
"""Paged decode attention against the memory floor and PyTorch's own attention, in one run.

A decode step's attention reads every cached K and V once, so its floor is those bytes over the
read bandwidth (``benchlib.hw_limits``, a 512 MB bf16 sum measured in the same run). For each
context length and page order (``contiguous``: each sequence's pages one after another;
``strided``: sequences that grew together, every n-th page; ``random``), it times the native
kernel (``kernels/cpu_decode_attn.c``) and, as the baseline, PyTorch's scaled_dot_product_attention
over the same K/V gathered from the pages, on the default model's attention shape (9 heads, 3 KV
heads, head_dim 64), bf16, one layer. Ends with one JSON line.

    .venv/bin/python scripts/bench_decode_attention.py [--threads 1] [--seqs 64] [--contexts 128 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

from benchlib.timing import best_of  # noqa: E402
from benchlib.hw_limits import read_bandwidth_gbs  # noqa: E402

from pdserve.kernels.cpu_native import native_kernels  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16
ORDERS = ("contiguous", "strided", "random")


def page_table(order: str, n: int, per_seq: int) -> torch.Tensor:
    ids = torch.arange(n * per_seq)
    if order == "strided":  # page i of sequence b is b + n * i: they took turns
        ids = ids.view(per_seq, n).t()
    elif order == "random":
        ids = torch.randperm(n * per_seq, generator=torch.Generator().manual_seed(0))
    return ids.int().reshape(n, per_seq).contiguous()


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    native = native_kernels()
    if native is None:
        sys.exit("native kernels unavailable (no C compiler?)")
    n, scale = args.seqs, DIM ** -0.5
    rows = []
    for ctx in args.contexts:
        per_seq = -(-ctx // PAGE)
        k = torch.randn(KV_HEADS, n * per_seq, PAGE, DIM).bfloat16()
        v = torch.randn_like(k)
        q = torch.randn(n, HEADS, DIM).bfloat16()
        lens = torch.full((n,), ctx, dtype=torch.int32)
        kv_bytes = 2 * n * ctx * KV_HEADS * DIM * k.element_size()
        for order in ORDERS:
            pt = page_table(order, n, per_seq)
            t_native = best_of(lambda: native.decode_attention(q, k, v, pt, lens, scale), args.repeats)

            def torch_sdpa():
                # gather each sequence's pages, then one batched attention: what the kernel avoids
                kk = k[:, pt.long()].reshape(KV_HEADS, n, per_seq * PAGE, DIM)[:, :, :ctx].transpose(0, 1)
                vv = v[:, pt.long()].reshape(KV_HEADS, n, per_seq * PAGE, DIM)[:, :, :ctx].transpose(0, 1)
                return F.scaled_dot_product_attention(q[:, :, None], kk, vv, scale=scale, enable_gqa=True)

            t_torch = best_of(torch_sdpa, args.repeats)
            rows.append({"context": ctx, "order": order, "native_ms": round(t_native * 1e3, 3),
                         "torch_ms": round(t_torch * 1e3, 3), "native_gbs": round(kv_bytes / t_native / 1e9, 1),
                         "native_vs_torch": round(t_torch / t_native, 2)})
            print(f"{n} seqs x {ctx} tokens, {order:<10}: native {t_native * 1e3:7.3f} ms "
                  f"({kv_bytes / t_native / 1e9:5.1f} GB/s), torch {t_torch * 1e3:7.3f} ms, "
                  f"{t_torch / t_native:.2f}x", file=sys.stderr, flush=True)
    bw = read_bandwidth_gbs(repeats=5)
    for r in rows:
        r["native_frac_of_read_bw"] = round(r["native_gbs"] / bw, 3)
    print(json.dumps({"bench": "decode_attention", "threads": args.threads, "seqs": n, "read_gbs": round(bw, 1),
                      "load_avg": round(os.getloadavg()[0], 1), "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
