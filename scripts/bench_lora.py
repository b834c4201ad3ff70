#!/usr/bin/env python
"""Decode throughput of the default model under LoRA against without, same run.

ModelRunner set-ups decode one step of ``--batch`` sequences (default 32) at a context of
``--context`` tokens, in bf16 (the native kernels):

- base: no ``--enable-lora`` (the fused decode step where the CPU allows it);
- lora-off: ``--enable-lora`` with ``--adapters`` adapters loaded, no row using one;
- lora-one: every row on one adapter (rank ``--rank`` on all seven projections);
- lora-mixed: the rows spread over all ``--adapters`` adapters (row i on adapter i mod N),
  the mix a fleet serving many fine-tunes of one base sends a server;
- lora-one-torch, lora-mixed-torch: lora-one's and lora-mixed's rows through the torch forms
  of the product (``LoraHook.native`` off: the stacked dense products, each linear called from
  Python) instead of the native segmented kernel inside the fused decode step.

The adapters are random, made with peft on the default model. Rounds alternate the set-ups
(``--rounds``; medians reported) so a change of load hits all alike. Each step is timed twice:
wall clock, and the CPU time of the thread that runs it (at ``--threads 1`` the whole step runs
in that thread, and its CPU time moves far less with other jobs on a shared machine). Ends with
one JSON line: each set-up's ms per step (wall and CPU), tokens per second and its rates
relative to base.

    .venv/bin/python scripts/bench_lora.py
    .venv/bin/python scripts/bench_lora.py --batch 1 8 32 --adapters 8 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_loader import load_model, save_hf_checkpoint
from pdserve.engine.model_executor.layers.lora_product import LoraHook
from pdserve.engine.model_executor.model_runner import ModelRunner

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(rank: int, n: int) -> list[str]:
    """``n`` random rank-``rank`` PEFT adapters of the default model, in a temporary directory."""
    import peft
    import transformers

    d = tempfile.mkdtemp(prefix="bench-lora-")
    arch, weights, _ = load_model(None)
    save_hf_checkpoint(arch, weights, d + "/base")
    del weights
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        model = transformers.LlamaForCausalLM.from_pretrained(d + "/base", dtype=torch.float32)
        cfg = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=MODULES, init_lora_weights=False)
        peft.get_peft_model(model, cfg).save_pretrained(f"{d}/a{i}")
        paths.append(f"{d}/a{i}")
    return paths


def step_ms(runner: ModelRunner, bs: int, slots: list[int] | None, ctx: int, reps: int) -> tuple[float, float]:
    """Mean ms of one decode step of ``bs`` sequences at ``ctx`` tokens, rows on ``slots``: wall
    clock, and the CPU time of this thread."""
    pool = runner.page_pool
    ps = pool.page_size
    pages = [pool.alloc(pool.pages_for(ctx + 1)) for _ in range(bs)]
    try:
        batch = ForwardBatch(
            input_ids=torch.randint(0, 1000, (bs,)),
            positions=torch.full((bs,), ctx),
            out_cache_loc=torch.tensor([p[ctx // ps] * ps + ctx % ps for p in pages]),
            page_table=torch.tensor(pages, dtype=torch.int32),
            logits_indices=torch.arange(bs),
            extend_lens=[1] * bs,
            seq_lens=[ctx + 1] * bs,
            lora_slots=None if slots is None else torch.tensor(slots),
        )
        runner.forward(batch)
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(reps):
            runner.forward(batch)
        return (time.perf_counter() - t0) / reps * 1000, (time.thread_time() - c0) / reps * 1000
    finally:
        for p in pages:
            pool.free(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--adapters", type=int, default=8, help="adapters loaded; lora-mixed spreads the rows over them")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5, help="steps timed per round")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    n = args.adapters
    paths = make_adapters(args.rank, n)
    common = dict(dtype="bfloat16", max_total_tokens=max(args.batch) * (args.context + 32) + 64, page_size=16)
    base = ModelRunner(EngineConfig(**common))
    lora = ModelRunner(EngineConfig(**common, max_loras_per_batch=n,
                                    lora_paths=tuple(f"a{i}={p}" for i, p in enumerate(paths))))
    lora.load_lora([(i, f"a{i}") for i in range(n)])
    summary = {}
    for bs in args.batch:
        setups = {"base": (base, None), "lora-off": (lora, None), "lora-one": (lora, [0] * bs),
                  "lora-mixed": (lora, [i % n for i in range(bs)]),
                  "lora-one-torch": (lora, [0] * bs),
                  "lora-mixed-torch": (lora, [i % n for i in range(bs)])}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in setups}
        for _ in range(args.rounds):
            for name, (runner, slots) in setups.items():
                LoraHook.native = not name.endswith("-torch")
                times[name].append(step_ms(runner, bs, slots, args.context, args.reps))
        LoraHook.native = True
        med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
        for name, ms in med.items():
            print(f"batch {bs}: {name}: {ms:.1f} ms/step, {bs / ms * 1000:.0f} tokens/s, "
                  f"{med['base'] / ms:.2f}x base's rate; CPU {cpu[name]:.1f} ms/step, "
                  f"{cpu['base'] / cpu[name]:.2f}x base's")
        summary[f"batch_{bs}"] = {k: {"ms": round(v, 2), "tokens_per_s": round(bs / v * 1000, 1),
                                      "vs_base": round(med["base"] / v, 3), "cpu_ms": round(cpu[k], 2),
                                      "cpu_vs_base": round(cpu["base"] / cpu[k], 3)} for k, v in med.items()}
    print(json.dumps({"bench": "lora_decode_step", "context": args.context, "rank": args.rank,
                      "adapters": n, **summary}))


if __name__ == "__main__":
    main()
