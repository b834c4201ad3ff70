#!/usr/bin/env python
"""Where one prefill step's time goes, against the floor this CPU's matmul peak sets.

Runs one model step of ``--num-prompts`` x ``--prompt-len`` new tokens (no
prefix) through the ModelRunner, times the native kernel calls (prefill
attention, RMSNorm, rope), the KV store and SDPA (the prefill attention where
the CPU has AMX) by wrapping them, and calls the rest "linears and the
remainder". Then measures this machine's bf16 GEMM rate on a
4096^3 product and prints the step's linear FLOPs at that rate: no engine
running these weights can take less. Last, the native prefill attention
against PyTorch's CPU flash attention (``scaled_dot_product_attention``) on
one ``--prompt-len`` sequence of the model's shape, alone and after as many
cached tokens (read in place from pool slots, or gathered for SDPA). Ends with
one JSON line.

    .venv/bin/python scripts/profile_prefill_step.py [--threads 2] [--num-prompts 4] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

from bench_model import prefill_batch  # noqa: E402
from benchlib.hw_limits import gemm_rate  # noqa: E402

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.model_executor.model_runner import ModelRunner  # noqa: E402


def attention_vs_sdpa(native, heads: int, kv_heads: int, dim: int, length: int,
                      prefix: int = 0) -> tuple[float, float]:
    """Seconds per call: native prefill attention, and causal SDPA (GQA), on the same bf16 q/k/v.
    With a ``prefix``: ``length`` new tokens over ``prefix + length`` keys in a pool's slots, read
    in place by the native kernel, gathered for SDPA (with the mask that aligns the diagonal), as
    the attention backend runs each."""
    import torch.nn.functional as F

    keys = prefix + length
    pool = torch.randn(2, 4 * keys, kv_heads, dim).bfloat16()
    rows = torch.randperm(4 * keys)[:keys]
    q = torch.randn(length, heads, dim).bfloat16()
    out = torch.empty(length, heads * dim, dtype=torch.bfloat16)
    mask = None if prefix == 0 else torch.arange(keys)[None, :] <= torch.arange(prefix, keys)[:, None]

    def sdpa():
        k, v = pool[0][rows], pool[1][rows]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                              scale=dim**-0.5, enable_gqa=True)

    calls = (lambda: native.prefill_attention(q, pool[0], pool[1], out, dim**-0.5, key_rows=rows), sdpa)
    times = []
    for call in calls:
        call()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(10):
                call()
            best = min(best, (time.perf_counter() - t) / 10)
        times.append(best)
    return times[0], times[1]


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, length = args.num_prompts, args.prompt_len
    runner = ModelRunner(EngineConfig(dtype="bfloat16", max_total_tokens=n * length + 64, num_threads=args.threads))
    ps = runner.page_pool.page_size
    pages = torch.tensor([runner.page_pool.alloc(runner.page_pool.pages_for(length)) for _ in range(n)],
                         dtype=torch.int32)
    slots = (pages.long()[:, :, None] * ps + torch.arange(ps)).reshape(n, -1)
    batch = prefill_batch(torch.randint(1000, 40000, (n, length)), pages, slots)
    spent: collections.Counter[str] = collections.Counter()

    def timed(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            spent[label] += time.perf_counter() - t
            return out

        setattr(obj, name, wrapper)

    native = runner.model.plan.native
    if native is not None:
        timed(native, "prefill_attention", "attention")
        timed(native, "rms_norm", "rms_norm")
        timed(native, "rope", "rope")
    import pdserve.engine.model_executor.attention.torch_backend as backend

    timed(backend, "store_kv", "kv_store")
    timed(torch.nn.functional, "scaled_dot_product_attention", "attention")  # where the step runs it (AMX)
    runner.forward(batch)  # warm: kernels built, caches touched
    best, parts = float("inf"), {}
    for _ in range(args.repeats):
        spent.clear()
        t = time.perf_counter()
        runner.forward(batch)
        total = time.perf_counter() - t
        if total < best:
            best, parts = total, dict(spent)
    arch = runner.arch
    hidden, inter, heads, kvh, dim = arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    per_token = hidden * (heads + 2 * kvh) * dim + heads * dim * hidden + 3 * hidden * inter  # weights per layer
    linear_flops = 2 * n * length * per_token * arch.num_layers
    attn_flops = n * arch.num_layers * 4 * heads * dim * length * length / 2  # causal QK^T and PV
    rate = gemm_rate()
    rest = best - sum(parts.values())
    result = {
        "bench": "prefill_step",
        "tokens": n * length,
        "step_s": round(best, 4),
        "tok_s": round(n * length / best, 1),
        "parts_ms": {k: round(v * 1e3, 1) for k, v in parts.items()} | {"linears_and_rest": round(rest * 1e3, 1)},
        "gemm_peak_gflops": round(rate, 1),
        "linear_gflop": round(linear_flops / 1e9, 1),
        "attention_gflop": round(attn_flops / 1e9, 1),
        "floor_s": round((linear_flops + attn_flops) / rate / 1e9, 4),
        "ceiling_tok_s": round(n * length * rate * 1e9 / (linear_flops + attn_flops), 1),
    }
    print(f"step {best * 1e3:.0f} ms ({result['tok_s']} tok/s): " + ", ".join(
        f"{k} {v} ms" for k, v in result["parts_ms"].items()))
    print(f"bf16 GEMM peak {rate:.0f} GFLOP/s; linears {result['linear_gflop']} GFLOP + attention "
          f"{result['attention_gflop']} GFLOP -> floor {result['floor_s'] * 1e3:.0f} ms, "
          f"ceiling {result['ceiling_tok_s']:.0f} tok/s")
    if native is not None and native.supports_prefill(torch.bfloat16, dim):
        for prefix in (0, length):
            t_native, t_sdpa = attention_vs_sdpa(native, heads, kvh, dim, length, prefix)
            tag = "" if prefix == 0 else "_prefix"
            result[f"attention{tag}_native_ms"] = round(t_native * 1e3, 3)
            result[f"attention{tag}_sdpa_ms"] = round(t_sdpa * 1e3, 3)
            result[f"attention{tag}_speedup"] = round(t_sdpa / t_native, 2)
            print(f"{length} new tokens after {prefix} cached, {heads}/{kvh} heads: native prefill attention "
                  f"{t_native * 1e3:.2f} ms, SDPA {t_sdpa * 1e3:.2f} ms (native {result[f'attention{tag}_speedup']}x; "
                  f"the step ran {'native' if runner.attn_backend.native_prefill else 'SDPA'})")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
