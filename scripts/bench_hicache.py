"""Multi-turn conversations with the hierarchical cache off, L2 (host tier), and L2 + storage tier.

N conversations of T turns; each turn's prompt is the whole history (previous
answers included) plus a new message of random token ids; the conversations of
a turn run concurrently, the turns one after the other (the think time). The
KV pool holds about a quarter of the live conversations, so without a lower
tier most of each history is evicted before its next turn. One invocation runs,
on the offline Engine (one server, colocated):

  off       the radix cache alone
  L2        --enable-hierarchical-cache (host tier large enough for every conversation)
  L2+file   the same plus --hicache-storage-backend file (a fresh directory)
  restart   a fresh engine on L2+file's directory replaying every conversation's last turn
            (a restarted server: its pool and host tier empty, the store full)

Reported per configuration: hit rate (cached prompt tokens over the ideal, every
earlier turn's tokens cached, page-aligned), prompt tokens computed, p50 TTFT
at turns >= 3; the last line compares them with ``off``.

    .venv/bin/python scripts/bench_hicache.py --conversations 8 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time

from pdserve.engine import Engine

PAGE = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--message-len", type=int, default=64, help="tokens of each turn's new message")
    p.add_argument("--answer-len", type=int, default=32, help="tokens of each answer")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append one JSON line with every figure")
    return p


async def one_turn(engine: Engine, prompt: list[int], answer_len: int) -> tuple[list[int], int, float]:
    """(answer ids, cached tokens, TTFT) of one request."""
    t0 = time.perf_counter()
    ttft = None
    last = None
    params = {"temperature": 0.0, "max_new_tokens": answer_len, "ignore_eos": True}
    async for chunk in await engine.async_generate(input_ids=prompt, sampling_params=params, stream=True):
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        last = chunk
    return last["output_ids"], last["meta_info"]["cached_tokens"], ttft


def ideal_cached(history_len: int, prompt_len: int) -> int:
    """Every earlier turn cached: the history's full pages, but for the KV no one computed (the last
    answer token's: decoding stops at it) and the last prompt token (always computed)."""
    return min(history_len - 1, prompt_len - 1) // PAGE * PAGE if history_len else 0


def run_turns(engine: Engine, turn_prompts, args, first_turn: int, histories_of) -> tuple[dict, list]:
    """Play turns in order; ``turn_prompts(t, histories)`` gives turn t's prompts. Returns the figures
    and every turn's prompts."""
    histories = [[] for _ in range(args.conversations)]
    cached = ideal = prompt_tokens = 0
    ttfts, played = [], []

    async def play():
        nonlocal cached, ideal, prompt_tokens
        for t in range(first_turn, args.turns):
            prompts = turn_prompts(t, histories)
            played.append(prompts)
            results = await asyncio.gather(*(one_turn(engine, p, args.answer_len) for p in prompts))
            for c, (prompt, (answer, hit, ttft)) in enumerate(zip(prompts, results)):
                cached += hit
                ideal += ideal_cached(histories_of(prompt), len(prompt))
                prompt_tokens += len(prompt)
                if t >= 2:
                    ttfts.append(ttft)
                histories[c] = prompt + answer

    asyncio.run(play())
    figures = {"hit_rate": round(cached / max(ideal, 1), 3), "cached": cached, "ideal": ideal,
               "computed": prompt_tokens - cached,
               "p50_ttft_s": round(statistics.median(ttfts), 4) if ttfts else None}
    return figures, played


def main() -> int:
    args = build_parser().parse_args()
    rng = random.Random(args.seed)
    messages = [[[rng.randrange(1000, 20000) for _ in range(args.message_len)] for _ in range(args.turns)]
                for _ in range(args.conversations)]
    final_len = args.turns * (args.message_len + args.answer_len)
    pool_tokens = max(args.conversations * final_len // 4, final_len + 2 * PAGE)
    common = {"max_total_tokens": pool_tokens, "num_threads": args.num_threads, "page_size": PAGE,
              "num_reserved_decode_tokens": args.answer_len}
    store_dir = tempfile.TemporaryDirectory(prefix="bench-hicache-")  # removed at exit
    store = store_dir.name
    l2 = {"enable_hierarchical_cache": True, "hicache_ratio": 4.0 * args.conversations * final_len / pool_tokens}
    l3 = {**l2, "hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "wait_complete",
          "hicache_storage_backend_extra_config": json.dumps({"path": store})}
    results, played = {}, {}
    history_len = lambda prompt: len(prompt) - args.message_len  # noqa: E731 - what came before the message
    for name, extra in (("off", {}), ("L2", l2), ("L2+file", l3), ("restart", l3)):
        with Engine(**common, **extra) as engine:
            if name == "restart":
                # the last turn's prompts as L2+file played them (greedy: the same answers)
                last = played["L2+file"][-1]
                # every one of them was computed (and stored) by L2+file: the whole prompt is the history
                results[name], _ = run_turns(engine, lambda t, h: last, args, args.turns - 1, lambda p: len(p) + 1)
            else:
                results[name], played[name] = run_turns(
                    engine, lambda t, h: [hc + m[t] for hc, m in zip(h, messages)], args, 0, history_len)
        print(name, results[name], flush=True)
    off, l3r = results["off"], results["L2+file"]
    print(f"bench_hicache: pool {pool_tokens} tokens for {args.conversations} conversations x {args.turns} turns; "
          f"hit rate off {off['hit_rate']} L2 {results['L2']['hit_rate']} L2+file {l3r['hit_rate']} "
          f"restart {results['restart']['hit_rate']}; computed L2+file/off "
          f"{l3r['computed'] / max(off['computed'], 1):.2f}; p50 TTFT (turns >= 3) L2+file/off "
          f"{l3r['p50_ttft_s'] / off['p50_ttft_s']:.2f}")
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": vars(args), "pool_tokens": pool_tokens, **results}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
