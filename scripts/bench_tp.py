"""Tensor parallel on this machine's cores: TP 1 (one process, 2 threads) against TP 2 (two
processes joined by gloo, 1 thread each, each pinned to its own core), same invocation.

Measures, on the default model through the real ModelRunner (its shard and KV pool per rank):
TTFT of one 512-token prompt (the prefill step), and decode tokens/s at 1 and 16 sequences;
at TP > 1 also the time spent inside the collectives (the all-reduce after o and down in
every layer, and the all-gather of the vocabulary-split logits), as a share of the step,
both as measured inside the real steps (which includes waiting for the slower rank) and
for the same collectives alone, back to back (the pure cost of the transport).

The default model cannot be split 2 ways (9 heads, 3 KV heads), so both TP 1 and TP 2 run
SmolLM2-135M with 8 heads and 2 KV heads (random attention weights; the same hidden size,
layers, MLPs, vocabulary and tied head: 3% fewer weights in all). Best of ``--repeats``
for each figure; every config runs in fresh processes. Ends with one JSON summary line.

Figures: docs/PERFORMANCE.md, "Tensor parallelism on one machine".

    .venv/bin/python scripts/bench_tp.py [--dtype bfloat16] [--repeats 3] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from bench_model import ours_generate
from pdserve.entrypoints.cluster import free_port, split_cpus
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor import parallel
from pdserve.engine.model_executor.model_loader import load_model, save_hf_checkpoint
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.text.tokenizer import load_tokenizer

HEADS, KV_HEADS = 8, 2  # a 2-way splittable variant of SmolLM2-135M's 9 / 3 (same head dim 64)


class CollectiveClock:
    """The duration of every torch.distributed all_reduce / all_gather call while installed."""

    def __init__(self):
        self.calls: list[float] = []

    def install(self) -> None:
        for name in ("all_reduce", "all_gather"):
            fn = getattr(dist, name)

            def timed(*a, _fn=fn, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.calls.append(time.perf_counter() - t0)

            setattr(dist, name, timed)

    def take(self) -> list[float]:
        out, self.calls = self.calls, []
        return out


def make_model(out_dir: str) -> None:
    """SmolLM2-135M's shape with HEADS / KV_HEADS heads: its dequantized embeddings and MLPs, random attention."""
    arch, weights, _ = load_model(None)
    arch = dataclasses.replace(arch, num_heads=HEADS, num_kv_heads=KV_HEADS)
    g = torch.Generator().manual_seed(0)
    D, hidden = arch.head_dim, arch.hidden_size
    for i in range(arch.num_layers):
        a = f"model.layers.{i}.self_attn."
        for name, rows in (("q_proj", HEADS * D), ("k_proj", KV_HEADS * D), ("v_proj", KV_HEADS * D)):
            weights[a + name + ".weight"] = torch.randn(rows, hidden, generator=g) * 0.02
        weights[a + "o_proj.weight"] = torch.randn(hidden, HEADS * D, generator=g) * 0.02
    save_hf_checkpoint(arch, weights, out_dir)
    load_tokenizer(None).save_pretrained(out_dir)


def measure(runner: ModelRunner, args, clock: CollectiveClock | None) -> dict:
    vocab = runner.arch.vocab_size
    per_step = 2 * runner.arch.num_layers + 1  # collectives of one forward step
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    prompt = torch.randint(100, vocab, (1, args.prefill_len), generator=g)
    ours_generate(runner, prompt[:, :64], 2)  # warm up
    best, coll = float("inf"), 0.0
    for _ in range(args.repeats):
        if clock:
            clock.take()
        wall, _, _, _ = ours_generate(runner, prompt, 1)
        calls = clock.take() if clock else []
        if wall < best:
            best, coll = wall, sum(calls)
    out["ttft_s"] = best
    if clock:
        out["ttft_collective_share"] = coll / best
    for bs in (1, 16):
        prompts = torch.randint(100, vocab, (bs, args.decode_prompt_len), generator=g)
        ours_generate(runner, prompts, 3)
        best, coll = float("inf"), 0.0
        for _ in range(args.repeats):
            if clock:
                clock.take()
            _, wall, _, _ = ours_generate(runner, prompts, args.new_tokens)
            calls = clock.take() if clock else []
            if wall < best:
                best, coll = wall, sum(calls[per_step:])  # the first step is the prefill
        out[f"decode{bs}_tok_s"] = bs * (args.new_tokens - 1) / best
        if clock:
            out[f"decode{bs}_collective_share"] = coll / best
    return out


def isolated_collectives(runner: ModelRunner, bs: int, rounds: int = 20) -> float:
    """Seconds of one decode step's collectives alone (2 per layer of [bs, hidden], one logits gather)."""
    arch, model = runner.arch, runner.model
    x = torch.zeros(bs, arch.hidden_size, dtype=runner.dtype)
    logits = torch.zeros(bs, model.vocab_shard, dtype=torch.float32)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(rounds):
        for _ in range(2 * arch.num_layers):
            dist.all_reduce(x)
        parallel.all_gather_last_dim(logits)
    return (time.perf_counter() - t0) / rounds


def rank_main(rank: int, tp: int, threads: int, cpus, addr: str, model_path: str | None, args, results) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    parallel.init_tp(rank, tp, addr, 300.0, torch.device("cpu"))
    runner = ModelRunner(EngineConfig(model_path=model_path, dtype=args.dtype, max_total_tokens=16 * 1024,
                                      num_threads=threads))
    clock = CollectiveClock() if tp > 1 else None
    box: dict = {}

    def work() -> None:  # in a worker thread, as the server runs its loop (see scheduler_process)
        torch.set_num_threads(threads)
        if clock:
            clock.install()
        box.update(measure(runner, args, clock))
        if tp > 1:
            for bs in (1, 16):  # as a share of the measured decode step
                step_s = bs / box[f"decode{bs}_tok_s"]
                box[f"decode{bs}_collective_alone_share"] = isolated_collectives(runner, bs) / step_s

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if rank == 0:
        results.put(box)
    parallel.close_tp()


def run_config(tp: int, threads: int, model_path: str | None, args) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cpus = sorted(os.sched_getaffinity(0))
    shares = split_cpus(cpus, tp) if tp <= len(cpus) else [None] * tp
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, tp, threads, shares[r], addr, model_path, args, results))
             for r in range(tp)]
    for p in procs:
        p.start()
    out = results.get(timeout=1800)
    for p in procs:
        p.join(60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp)
        tp1 = run_config(1, 2, tmp, args)
        print(json.dumps({"tp": 1, "threads": 2, **{k: round(v, 4) for k, v in tp1.items()}}), flush=True)
        tp2 = run_config(2, 1, tmp, args)
        print(json.dumps({"tp": 2, "threads": 1, **{k: round(v, 4) for k, v in tp2.items()}}), flush=True)
    summary = {
        "ttft_tp2_over_tp1": tp2["ttft_s"] / tp1["ttft_s"],
        "decode1_tp2_over_tp1": tp2["decode1_tok_s"] / tp1["decode1_tok_s"],
        "decode16_tp2_over_tp1": tp2["decode16_tok_s"] / tp1["decode16_tok_s"],
        "tp2_ttft_collective_share": tp2["ttft_collective_share"],
        "tp2_decode1_collective_share": tp2["decode1_collective_share"],
        "tp2_decode16_collective_share": tp2["decode16_collective_share"],
        "tp2_decode1_collective_alone_share": tp2["decode1_collective_alone_share"],
        "tp2_decode16_collective_alone_share": tp2["decode16_collective_alone_share"],
        "load_avg_1m_at_start": load,
        "dtype": args.dtype,
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


if __name__ == "__main__":
    main()
