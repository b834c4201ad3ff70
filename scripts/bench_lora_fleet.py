#!/usr/bin/env python
"""A fleet of 2 workers serving 8 LoRA adapters: adapter-aware routing against round robin.

    .venv/bin/python scripts/bench_lora_fleet.py                  # a few minutes on CPU
    .venv/bin/python scripts/bench_lora_fleet.py --num-requests 96 --request-rate 3

Two colocated servers on the default model behind the router (each a ``--decode`` worker that
serves alone), ``--max-loras-per-batch`` slots each (default 4: half the adapters), the same
requests at the same arrival times in both set-ups (each names one of the 8 adapters, uniformly,
fixed seed; random prompt ids):

- adapter_aware: worker i starts with the adapters a{j} where j % 2 == i (``--lora-paths``); the
  router runs its default policy with ``--lora-paths`` naming all 8, so it sends each request to
  the worker holding its adapter (router/workers/adapters.py) and each worker's 4 slots hold
  every adapter it serves;
- round_robin: both workers start with all 8 adapters and the router runs ``--policy round_robin``
  (every worker holds every adapter, so none is preferred): each worker sees all 8 adapters
  over its 4 slots.

Reported per set-up: p50 and p99 TTFT at the client (streamed ``/generate``), adapter loads per
minute (and per 100 requests) from the workers' ``/metrics`` (``pdserve_lora_adapter_loads_total{into="slot"}``: an
adapter's weights copied into a slot; ``into="host"`` counted apart: a checkpoint read from disk,
at start or by the router's ``/load_lora_adapter``), and the ratios adapter_aware / round_robin.
Each worker first serves two requests straight (its first LoRA step's one-time costs), before the
counters are read. The adapters are random rank-``--rank`` PEFT checkpoints on all seven projections. Ends with ONE
JSON line (also appended to ``--output-file``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request

import aiohttp
import torch

from pdserve.engine.model_executor.model_loader import load_arch
from pdserve.entrypoints.procs import free_port, log_tail, spawn, stop_groups, wait_healthy

HOST = "127.0.0.1"
NUM_ADAPTERS = 8
MODULES = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
           "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
           "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
           "mlp.down_proj": ("inter", "hidden")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=2.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--input-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras-per-batch", type=int, default=4, help="each worker's LoRA slots")
    p.add_argument("--num-threads", type=int, default=1, help="each worker's compute threads")
    p.add_argument("--modes", nargs="+", choices=("adapter_aware", "round_robin"),
                   default=["adapter_aware", "round_robin"])
    p.add_argument("--model-path", default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append the JSON line here too")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p


def make_adapters(out_dir: str, model_path: str | None, rank: int) -> dict[str, str]:
    """``NUM_ADAPTERS`` random PEFT adapters of the model, written as PEFT lays them out."""
    from safetensors.torch import save_file

    arch = load_arch(model_path)
    dims = {"hidden": arch.hidden_size, "q": arch.num_heads * arch.head_dim,
            "kv": arch.num_kv_heads * arch.head_dim, "inter": arch.intermediate_size}
    paths = {}
    for i in range(NUM_ADAPTERS):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(arch.num_layers):
            for module, (d_in, d_out) in MODULES.items():
                prefix = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, dims[d_in], generator=g) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(dims[d_out], rank, generator=g) * 0.02
        path = os.path.join(out_dir, f"a{i}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
                       "target_modules": [m.split(".")[1] for m in MODULES]}, f)
        paths[f"a{i}"] = path
    return paths


def workload(args) -> list[tuple[float, str, list[int]]]:
    """(arrival offset s, adapter, prompt ids) per request: Poisson arrivals, uniform adapters."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(args.request_rate)
        out.append((t, f"a{rng.randrange(NUM_ADAPTERS)}", [rng.randrange(1000, 40000) for _ in range(args.input_len)]))
    return out


async def one_request(session: aiohttp.ClientSession, url: str, adapter: str, ids: list[int],
                      output_len: int) -> tuple[float, str]:
    """(TTFT in s, the worker that served it) of one streamed /generate."""
    body = {"input_ids": ids, "lora_path": adapter, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{adapter}: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if ttft is None and line.startswith(b"data:") and b"[DONE]" not in line:
                ttft = time.perf_counter() - t0
        return ttft if ttft is not None else time.perf_counter() - t0, resp.headers.get("x-pdserve-decode", "")


async def drive(url: str, rows, output_len: int) -> list[tuple[float, str]]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()

        async def at(offset, adapter, ids):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await one_request(session, url, adapter, ids, output_len)

        return await asyncio.gather(*(at(*row) for row in rows))


def loads(url: str) -> dict[str, float]:
    """The worker's adapter loads so far, by ``into`` (summed over its ranks)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {"host": 0.0, "slot": 0.0}
    for into, value in re.findall(r'^pdserve_lora_adapter_loads_total\{[^}]*into="(\w+)"[^}]*\} (\S+)$', text, re.M):
        out[into] += float(value)
    return out


def run_mode(mode: str, adapters: dict[str, str], rows, args, log_dir: str) -> dict:
    names = sorted(adapters)
    procs, workers = [], []
    held_by = [names if mode == "round_robin" else [n for j, n in enumerate(names) if j % 2 == i] for i in range(2)]
    try:
        for i, held in enumerate(held_by):
            port = free_port()
            argv = [sys.executable, "-m", "pdserve.engine", "--host", HOST, "--port", str(port),
                    "--num-threads", str(args.num_threads), "--log-level", "warning",
                    "--max-loras-per-batch", str(args.max_loras_per_batch),
                    "--lora-paths", *(f"{n}={adapters[n]}" for n in held)]
            if args.model_path:
                argv += ["--model-path", args.model_path]
            procs.append(spawn(argv, os.path.join(log_dir, f"{mode}-worker-{i}.log"), die_with_parent=True))
            workers.append(f"http://{HOST}:{port}")
        for i, (u, p) in enumerate(zip(workers, procs)):
            log = os.path.join(log_dir, f"{mode}-worker-{i}.log")
            wait_healthy(u, p, args.startup_timeout, name=f"worker {i}", log=lambda log=log: f"{log}:\n{log_tail(log)}")
        port = free_port()
        url = f"http://{HOST}:{port}"
        argv = [sys.executable, "-m", "pdserve.router", "--host", HOST, "--port", str(port), "--log-level", "warning",
                "--lora-paths", *(f"{n}={adapters[n]}" for n in names)]
        argv += ["--policy", "round_robin"] if mode == "round_robin" else []
        for u in workers:
            argv += ["--decode", u]
        log = os.path.join(log_dir, f"{mode}-router.log")
        procs.append(spawn(argv, log, die_with_parent=True))
        wait_healthy(url, procs[-1], 120, name=f"router ({mode})", log=lambda: f"{log}:\n{log_tail(log)}")
        # a first LoRA step on each worker (its one-time costs), straight to it; the router reads
        # each worker's adapters (/v1/models) at its first health probe meanwhile
        for u, held in zip(workers, held_by):
            for _ in range(2):
                asyncio.run(drive(u, [(0.0, held[0], rows[0][2])], args.output_len))
        time.sleep(2.0)
        before = [loads(u) for u in workers]
        t0 = time.perf_counter()
        results = asyncio.run(drive(url, rows, args.output_len))
        minutes = (time.perf_counter() - t0) / 60
        after = [loads(u) for u in workers]
    finally:
        stop_groups(procs)
    ttfts = sorted(r[0] * 1000 for r in results)
    per_worker = [sum(1 for r in results if r[1] == u) for u in workers]
    slot = sum(a["slot"] - b["slot"] for a, b in zip(after, before))
    host = sum(a["host"] - b["host"] for a, b in zip(after, before))
    return {"mode": mode, "completed": len(results), "minutes": round(minutes, 3),
            "p50_ttft_ms": round(statistics.median(ttfts), 1),
            "p99_ttft_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "slot_loads": slot, "slot_loads_per_min": round(slot / minutes, 2),
            "slot_loads_per_100_requests": round(100 * slot / len(results), 2),
            "host_loads_during_run": host, "requests_per_worker": per_worker}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the finally blocks stop the servers
    log_dir = tempfile.mkdtemp(prefix="pdserve-lora-fleet-")
    adapters = make_adapters(log_dir, args.model_path, args.rank)
    rows = workload(args)
    load = os.getloadavg()[0]
    print(f"bench_lora_fleet: {len(os.sched_getaffinity(0))} cores (load average {load:.1f}), "
          f"{len(rows)} requests at {args.request_rate}/s over {NUM_ADAPTERS} adapters, "
          f"{args.max_loras_per_batch} slots per worker, logs in {log_dir}", flush=True)
    runs = [run_mode(mode, adapters, rows, args, log_dir) for mode in args.modes]
    by = {r["mode"]: r for r in runs}
    print(f"\n{'mode':<14} {'p50 TTFT ms':>12} {'p99 TTFT ms':>12} {'slot loads/min':>15} {'per 100 req':>12} "
          f"{'requests/worker':>16}")
    for r in runs:
        print(f"{r['mode']:<14} {r['p50_ttft_ms']:>12.1f} {r['p99_ttft_ms']:>12.1f} {r['slot_loads_per_min']:>15.2f} "
              f"{r['slot_loads_per_100_requests']:>12.2f} {str(r['requests_per_worker']):>16}")
    summary = {"bench": "lora_fleet", "cores": len(os.sched_getaffinity(0)), "load_avg_start": round(load, 2),
               "load_avg_end": round(os.getloadavg()[0], 2), "requests": len(rows),
               "request_rate": args.request_rate, "max_loras_per_batch": args.max_loras_per_batch,
               "rank": args.rank, "runs": runs}
    if "adapter_aware" in by and "round_robin" in by:
        a, rr = by["adapter_aware"], by["round_robin"]
        summary["p50_ttft_ratio"] = round(a["p50_ttft_ms"] / rr["p50_ttft_ms"], 3)
        summary["slot_loads_per_min_ratio"] = (round(a["slot_loads_per_min"] / rr["slot_loads_per_min"], 3)
                                               if rr["slot_loads_per_min"] else None)
        print(f"adapter_aware / round_robin: p50 TTFT {summary['p50_ttft_ratio']}x, "
              f"slot loads per minute {summary['slot_loads_per_min_ratio']}x")
    line = json.dumps(summary)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
