"""One MLA layer's decode attention at DeepSeek-V2-Lite's and DeepSeek-V3's shapes, bf16, same run:
the native absorbed kernel (``kernels/cpu_mla_decode.c``) against its torch twin and against the
expanded form (decompress every cached latent into per-head K and V, then attend), at batch 1 and
64 and contexts 1k and 8k; and the KV bytes per token of MLA against GQA and MHA of the same hidden
size. Each case times the attention from the query projections' output to the o_proj input (W_UK
and W_UV products included in the absorbed forms). Best of ``--repeats``. The expanded form at
batch 64 runs ``--expanded-rows`` rows and scales linearly (it is one independent pass per row).
``--kernel-only``: the decode attention alone (the kernel against its twin on the same query,
taking turns each repeat; the median of the repeats' ratios), the figure a kernel change moves.
Ends with one JSON line.

    .venv/bin/python scripts/bench_mla.py [--threads 2] [--repeats 3] [--shapes v2-lite,v3] [--kernel-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.mla_decode import MLADecodeKernel, mla_decode_torch

# heads, kv_lora_rank, rope dim, nope dim, v dim, hidden, layers, routed experts, top-k
SHAPES = {
    "v2-lite": dict(heads=16, r=512, dr=64, dn=128, dv=128, hidden=2048, layers=27, experts=64, topk=6),
    "v3": dict(heads=128, r=512, dr=64, dn=128, dv=128, hidden=7168, layers=61, experts=256, topk=8),
}
PAGE = 64


def best(fn, repeats: int) -> float:
    fn()  # warm: page faults, the kernel library
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def turns(fn_a, fn_b, repeats: int) -> tuple[float, float, float]:
    """Best times of ``fn_a`` and ``fn_b`` run in turns, and the median of the repeats' b / a."""
    fn_a(), fn_b()  # warm
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((fn_a, ta), (fn_b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return min(ta), min(tb), statistics.median(b / a for a, b in zip(ta, tb))


def run_case(s: dict, bs: int, ctx: int, repeats: int, expanded_rows: int, native,
             kernel_only: bool = False) -> dict:
    H, r, dr, dn, dv = s["heads"], s["r"], s["dr"], s["dn"], s["dv"]
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    pages_per_seq = ctx // PAGE
    cache = (torch.randn(1, bs * pages_per_seq + 1, PAGE, r + dr, generator=gen) * 0.1).to(dt)
    table = (torch.arange(bs * pages_per_seq, dtype=torch.int32) + 1).view(bs, pages_per_seq)
    lens = torch.full((bs,), ctx, dtype=torch.int32)
    q_nope = torch.randn(bs, H, dn, generator=gen).to(dt)
    q_pe = torch.randn(bs, H, dr, generator=gen).to(dt)
    w_kv_b = (torch.randn(H * (dn + dv), r, generator=gen) * r ** -0.5).to(dt)
    w = w_kv_b.view(H, dn + dv, r)
    w_uk, w_uv = w[:, :dn].contiguous(), w[:, dn:].contiguous()
    scale = (dn + dr) ** -0.5

    def absorbed(decode):
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q = torch.cat([q_lat, q_pe], dim=-1).contiguous()
        o = decode(q, cache, table, lens, r, scale)
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2))

    def expanded():
        for b in range(min(bs, expanded_rows)):
            lat = cache[0, table[b].long()].reshape(-1, r + dr)  # [ctx, W]
            kv = F.linear(lat[:, :r], w_kv_b).view(ctx, H, dn + dv)
            k = torch.cat([kv[..., :dn], lat[:, None, r:].expand(ctx, H, dr)], dim=-1)
            q = torch.cat([q_nope[b], q_pe[b]], dim=-1)[:, None]  # [H, 1, dn + dr]
            F.scaled_dot_product_attention(q, k.transpose(0, 1), kv[..., dn:].transpose(0, 1), scale=scale)

    row = {"batch": bs, "context": ctx}
    kernel = MLADecodeKernel(native)
    if kernel_only:
        q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe], dim=-1).contiguous()
        a, b, ratio = turns(lambda: kernel(q, cache, table, lens, r, scale),
                            lambda: mla_decode_torch(q, cache, table, lens, r, scale), repeats)
        return {**row, "native_ms": a * 1e3, "torch_twin_ms": b * 1e3, "twin_over_native": ratio,
                "kernel_isa": kernel.isa}
    row["native_ms"] = best(lambda: absorbed(kernel), repeats) * 1e3
    row["torch_twin_ms"] = best(lambda: absorbed(mla_decode_torch), repeats) * 1e3
    row["expanded_ms"] = best(expanded, repeats) * 1e3 * bs / min(bs, expanded_rows)
    row["twin_over_native"] = row["torch_twin_ms"] / row["native_ms"]
    row["expanded_over_native"] = row["expanded_ms"] / row["native_ms"]
    row["kernel_isa"] = kernel.isa
    return row


def kv_bytes(s: dict) -> dict:
    """Per token over all layers, bf16: MLA's latent vs GQA (8 KV heads of 128) and MHA of the
    same hidden size (hidden / 128 heads of 128)."""
    mla = s["layers"] * (s["r"] + s["dr"]) * 2
    gqa = s["layers"] * 2 * 8 * 128 * 2
    mha = s["layers"] * 2 * (s["hidden"] // 128) * 128 * 2
    return {"mla": mla, "gqa8": gqa, "mha": mha, "gqa8_over_mla": gqa / mla, "mha_over_mla": mha / mla}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default="v2-lite,v3")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--expanded-rows", type=int, default=2)
    ap.add_argument("--kernel-only", action="store_true", help="the decode attention alone, kernel vs twin")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = native_kernels()
    if native is None:
        raise SystemExit("the native kernels are not built (no C compiler): nothing to compare")
    summary = {}
    for name in args.shapes.split(","):
        s = SHAPES[name]
        rows = [run_case(s, int(bs), int(ctx), args.repeats, args.expanded_rows, native, args.kernel_only)
                for bs in args.batches.split(",") for ctx in args.contexts.split(",")]
        for row in rows:
            if args.kernel_only:
                print(f"{name:8s} bs {row['batch']:3d} ctx {row['context']:5d}: native {row['native_ms']:9.2f} ms  "
                      f"twin {row['torch_twin_ms']:9.2f} ms (median twin / native {row['twin_over_native']:.2f})",
                      flush=True)
                continue
            print(f"{name:8s} bs {row['batch']:3d} ctx {row['context']:5d}: native {row['native_ms']:9.2f} ms  "
                  f"twin {row['torch_twin_ms']:9.2f} ms ({row['twin_over_native']:.2f}x)  expanded "
                  f"{row['expanded_ms']:10.2f} ms ({row['expanded_over_native']:.1f}x)", flush=True)
        summary[name] = {"shape": s, "cases": rows, "kv_bytes_per_token": kv_bytes(s)}
        print(f"{name}: KV bytes/token {json.dumps(summary[name]['kv_bytes_per_token'])}", flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
