#!/usr/bin/env python
"""One decode step against the floor this CPU's read bandwidth sets, five ways, in one run.

Loads the model five times (bf16 with the decode steps through oneDNN's prepacked linears;
bf16 through native gemv op by op from Python (``gemv``) and in one native call per step
(``fused``); w8a16 through int8 gemv, the same two ways), prefills ``--batch`` sequences in
each, then times single decode steps, alternating between them so that load from other jobs
hits them alike (best of ``--repeats``). The floor of a step at batch 1 is its weight bytes
over the read bandwidth of a 512 MB bf16 sum, measured in the same run. Last, the LM head's
product alone at one row, oneDNN prepacked vs gemv vs a sum over the same bytes: where a
step's time goes when it is a stream over the weights. Ends with one JSON line.

    .venv/bin/python scripts/profile_decode_step.py [--threads 1] [--batch 1] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

from bench_model import prefill_batch  # noqa: E402
from benchlib.baselines import ONEDNN_LINEARS  # noqa: E402
from benchlib.timing import best_of  # noqa: E402
from benchlib.hw_limits import linear_params, read_bandwidth_gbs  # noqa: E402

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.mem_cache.forward_batch import ForwardBatch  # noqa: E402
from pdserve.engine.model_executor.model_runner import ModelRunner  # noqa: E402
from pdserve.kernels.cpu_native import native_kernels  # noqa: E402

SIDES = {
    "onednn": ONEDNN_LINEARS,
    "gemv": dict(disable_fused_decode=True),
    "fused": {},
    "w8a16_ops": dict(quantization="w8a16", disable_fused_decode=True),
    "w8a16": dict(quantization="w8a16"),
}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=64, help="cached tokens per sequence")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bs, ctx = args.batch, args.context
    steps = {}
    runners = {}
    for name, kw in SIDES.items():
        runner = ModelRunner(EngineConfig(dtype="bfloat16", max_total_tokens=bs * (ctx + 32) + 64,
                                          num_threads=args.threads, **kw))
        pool, ps = runner.page_pool, runner.page_pool.page_size
        pages = torch.tensor([pool.alloc(pool.pages_for(ctx + 1)) for _ in range(bs)], dtype=torch.int32)
        slots = (pages.long()[:, :, None] * ps + torch.arange(ps)).reshape(bs, -1)
        runner.forward(prefill_batch(torch.randint(1000, 30000, (bs, ctx)), pages, slots))
        step = ForwardBatch(  # the step after the prompt, rerun: the same work every time
            input_ids=torch.randint(1000, 30000, (bs,)), positions=torch.full((bs,), ctx),
            out_cache_loc=slots[:, ctx].contiguous(), page_table=pages, logits_indices=torch.arange(bs),
            extend_lens=[1] * bs, seq_lens=[ctx + 1] * bs,
        )
        runners[name] = runner
        steps[name] = (lambda r=runner, b=step: r.forward(b))
    times = {name: float("inf") for name in SIDES}
    for _ in range(args.repeats):  # alternate: a loaded moment hits every side alike
        for name, fn in steps.items():
            times[name] = min(times[name], best_of(fn, 1))
    bw = read_bandwidth_gbs(repeats=10)
    params = linear_params(runners["gemv"].arch)
    floors = {name: (1 if name.startswith("w8a16") else 2) * params / bw / 1e9 for name in SIDES}
    result = {
        "bench": "decode_step", "threads": args.threads, "batch": bs, "context": ctx,
        "load_avg": round(os.getloadavg()[0], 1), "read_gbs": round(bw, 1),
        **{f"{n}_step_ms": round(t * 1e3, 2) for n, t in times.items()},
        **({f"{n}_frac_of_floor": round(floors[n] / t, 3) for n, t in times.items()} if bs == 1 else {}),
        "gemv_vs_onednn": round(times["onednn"] / times["gemv"], 2),
        "fused_vs_gemv": round(times["gemv"] / times["fused"], 2),
        "fused_vs_onednn": round(times["onednn"] / times["fused"], 2),
        "w8a16_fused_vs_ops": round(times["w8a16_ops"] / times["w8a16"], 2),
        "w8a16_vs_fused": round(times["fused"] / times["w8a16"], 2),
    }
    native = native_kernels()
    if native is not None and native.has_gemv:
        head = runners["gemv"].model.lm_head.method.gemv  # [vocab, hidden] bf16, packed for gemv
        base = runners["onednn"].model  # the same, prepacked for oneDNN where the CPU has native bf16
        x = torch.randn(1, head.cols).bfloat16()
        if base.plan.packed:
            lp = torch.ops.mkldnn._linear_pointwise
            linear = lambda: lp(x, base.lm_head.method.large, None, "none", [], "")  # noqa: E731
        else:
            linear = lambda: torch.nn.functional.linear(x, base.lm_head.method.large)  # noqa: E731
        parts = {
            "onednn": best_of(linear, args.repeats),
            "gemv": best_of(lambda: native.gemv(x, head), args.repeats),
            "sum": best_of(lambda: head.data.sum(), args.repeats),
        }
        mb = head.data.numel() * 2 / 1e6
        result |= {f"lm_head_{k}_gbs": round(mb / 1e3 / v, 1) for k, v in parts.items()}
    print(f"decode step at batch {bs} ({args.threads} threads, load {result['load_avg']}): " + ", ".join(
        f"{n} {t * 1e3:.2f} ms" for n, t in times.items()) + f"; read {bw:.1f} GB/s", file=sys.stderr)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
