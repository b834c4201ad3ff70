"""One MoE layer on 2 ranks (gloo): expert parallelism's all-to-all against tensor parallelism's all-reduce.

    .venv/bin/python scripts/bench_ep_layer.py                 # Qwen3-30B-A3B's MoE layer shape
    .venv/bin/python scripts/bench_ep_layer.py --tokens 1 16 256 --repeats 5 --threads 1

Two processes joined by gloo build the same layer twice from the same random bf16 weights (hidden
2048, 128 experts of 768 intermediate rows, top 8 by default):

- ``tp``: ``--ep-size 1``: every rank holds every expert's half of the intermediate rows, runs the
  step's tokens through them and the halves are summed by an all-reduce;
- ``ep``: ``--ep-size 2 --moe-a2a-backend gloo``: each rank holds 64 whole experts, takes half of
  the step's tokens and sends each (token, expert) pair to its expert's rank by an all-to-all,
  the outputs come back by another, and an all-gather restores the step on both ranks.

Per step size, both ranks run the same routed tokens (uniform random top-k, seeded) through each
layer in turn, best of ``--repeats`` after a warm-up; tokens per second = tokens / rank 0's step
time. Ends with ONE JSON line: per step size both rates and ep / tp.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import torch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return p


def _layer(args, ep_size: int, backend: str, tp):
    """A FusedMoE of the benchmark's shape under EP ``ep_size``, loaded with the seeded weights."""
    from pdserve.engine.model_executor.layers import FusedMoE, KernelPlan, can_prepack
    from pdserve.engine.model_executor.layers.moe_fused import moe_method
    from pdserve.engine.model_executor.model_runner import cpu_supports_bf16
    from pdserve.engine.model_executor.parallel import init_ep

    init_ep(ep_size, backend)  # read by the layer as it is built
    cpu = torch.device("cpu")
    plan = KernelPlan.choose(torch.bfloat16, cpu, prepack=can_prepack(torch.bfloat16, cpu, cpu_supports_bf16()))
    layer = FusedMoE(plan, args.experts, args.top_k, args.hidden, args.inter, tp, method=moe_method(plan, args.experts))
    g = torch.Generator().manual_seed(1)
    for e in range(args.experts):  # the same weights on every rank and in both layers
        for shard, shape, fan_in in (("w1", (args.inter, args.hidden), args.hidden),
                                     ("w3", (args.inter, args.hidden), args.hidden),
                                     ("w2", (args.hidden, args.inter), args.inter)):
            w = (torch.randn(*shape, generator=g) / fan_in**0.5).bfloat16()
            layer.weight_loader("experts", w, shard, e)
    layer.process_weights()
    return layer


def _rank(rank: int, addr: str, args, out) -> None:
    from pdserve.engine.model_executor.layers import Step
    from pdserve.engine.model_executor.parallel import close_tp, head_shard, init_tp

    torch.set_num_threads(args.threads)
    init_tp(rank, 2, addr, 600.0, torch.device("cpu"))
    tp = head_shard(rank, 2, 2, 2)  # the MoE layer reads only the TP rank and size
    layers = {"tp": _layer(args, 1, "none", tp), "ep": _layer(args, 2, "gloo", tp)}
    g = torch.Generator().manual_seed(2)
    results = {}
    for n in args.tokens:
        x = torch.randn(n, args.hidden, generator=g).bfloat16()  # [T, hidden], the same on both ranks
        ids = torch.stack([torch.randperm(args.experts, generator=g)[: args.top_k] for _ in range(n)])  # [T, k]
        weights = torch.rand(n, args.top_k, generator=g).softmax(-1)  # [T, k] float32
        step = Step(n, n <= 16)
        best = dict.fromkeys(layers, float("inf"))
        outputs = {}
        for i in range(args.repeats + 1):
            for name, layer in layers.items():
                torch.distributed.barrier()
                t0 = time.perf_counter()
                outputs[name] = layer.forward_routed(x, weights, ids, step)
                if i:  # the first round warms up
                    best[name] = min(best[name], time.perf_counter() - t0)
        diff = (outputs["ep"].float() - outputs["tp"].float()).abs().max().item()
        results[n] = {"tp_tokens_per_s": round(n / best["tp"], 1), "ep_tokens_per_s": round(n / best["ep"], 1),
                      "ep_over_tp": round(best["tp"] / best["ep"], 3), "max_abs_diff": diff}
    if rank == 0:
        out.put(results)
    close_tp()


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from pdserve.entrypoints.cluster import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, addr, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = out.get(timeout=3600)
    for p in procs:
        p.join(60)
    summary = {"bench": "ep_layer", "ranks": 2, "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
               "inter": args.inter, "threads_per_rank": args.threads, "dtype": "bfloat16", "results": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
