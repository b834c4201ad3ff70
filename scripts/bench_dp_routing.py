"""Router DP-rank balance under a skewed workload: ``--dp-rank-policy least_tokens`` against ``round_robin``.

    .venv/bin/python scripts/bench_dp_routing.py                  # about a minute
    .venv/bin/python scripts/bench_dp_routing.py --rate 20 --rounds 3

One stand-in prefill and one stand-in decode worker (``tests/support/standin_worker.py``), each
reporting 2 DP ranks, and one pdserve router per rule in front of them, all in this process's
event loop. The decode stand-in models what makes a DP rank's load matter: each rank holds at most
``--rank-token-budget`` tokens (prompt + max new tokens, as a KV pool bounds it) at once, a request
that does not fit waits (first come, first served) before its first byte, and tokens stream every
``--token-delay-ms``. The workload (fixed seed): Poisson arrivals at ``--rate``, ``--long-share`` of
long requests (``--long-prompt``/``--long-output`` tokens) among short ones, streamed ``/generate``.
The same arrivals go through each router in turn (``--rounds`` alternations; medians over rounds).

Reported per rule: mean, p50 and p99 TTFT at the client, and the decode ranks' balance: the busier
rank's share of the tokens (held plus waiting, as the stand-in counts them), sampled every 20 ms
while any are held: its median (0.5: even), and the fraction of samples where one rank has over
1.5x the other's (share > 0.6). Ratios are round_robin over least_tokens. ONE JSON line at the
end. The workers are stand-ins: the figures measure the routing rule, not the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))  # the stand-in worker is test code

from standin_worker import Behavior, StandinWorker  # noqa: E402

from pdserve.router.config import DP_RANK_POLICIES, RouterConfig, WorkerSpec  # noqa: E402
from pdserve.router.server import start_router  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--rate", type=float, default=14.0, help="arrivals per second (Poisson)")
    p.add_argument("--long-share", type=float, default=0.1)
    p.add_argument("--long-prompt", type=int, default=3000)
    p.add_argument("--long-output", type=int, default=40)
    p.add_argument("--short-prompt", type=int, default=200)
    p.add_argument("--short-output", type=int, default=8)
    p.add_argument("--rank-token-budget", type=int, default=6000)
    p.add_argument("--token-delay-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p


def workload(args) -> list[tuple[float, dict]]:
    """(arrival offset in seconds, body) per request, the same for every rule."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        long = rng.random() < args.long_share
        prompt, new = (args.long_prompt, args.long_output) if long else (args.short_prompt, args.short_output)
        out.append((t, {"input_ids": [11] * prompt, "stream": True,
                        "sampling_params": {"max_new_tokens": new}}))
    return out


async def one(session: aiohttp.ClientSession, url: str, at: float, start: float, body: dict) -> float:
    """TTFT of ``body`` sent ``at`` seconds after ``start``."""
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    t0 = time.perf_counter()
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        await r.content.readany()
        ttft = time.perf_counter() - t0
        await r.read()
    return ttft


async def run_rule(url: str, decode: StandinWorker, work, session) -> dict:
    samples: list[float] = []
    done = False

    async def sample() -> None:
        while not done:
            held = [decode.rank_load(r) for r in (0, 1)]
            if sum(held):
                samples.append(max(held) / sum(held))  # the busier rank's share: 0.5 even, 1.0 all
            await asyncio.sleep(0.02)

    sampler = asyncio.ensure_future(sample())
    start = time.perf_counter() + 0.05
    ttfts = await asyncio.gather(*(one(session, url, at, start, body) for at, body in work))
    done = True
    await sampler
    ttfts.sort()
    samples.sort()
    return {"ttft_mean_ms": 1000 * statistics.fmean(ttfts), "ttft_p50_ms": 1000 * pct(ttfts, 50),
            "ttft_p99_ms": 1000 * pct(ttfts, 99),
            "busier_share_p50": pct(samples, 50),
            "time_over_1_5x": sum(s > 0.6 for s in samples) / max(len(samples), 1)}  # max/min > 1.5


def pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q / 100))]


async def main_async(args) -> dict:
    prefill = StandinWorker("prefill", Behavior(dp_size=2, record=False))
    decode = StandinWorker("decode", Behavior(dp_size=2, record=False, rank_token_budget=args.rank_token_budget,
                                              token_delay_s=args.token_delay_ms / 1000.0))
    await prefill.start()
    await decode.start()
    routers = {}
    try:
        for rule in DP_RANK_POLICIES:
            cfg = RouterConfig(prefill=(WorkerSpec(prefill.url, "prefill", 8998),),
                               decode=(WorkerSpec(decode.url, "decode"),), host="127.0.0.1", port=0,
                               dp_rank_policy=rule, log_level="warning")
            _, runner, port = await start_router(cfg)
            routers[rule] = (runner, f"http://127.0.0.1:{port}")
        work = workload(args)
        per_rule: dict[str, list[dict]] = {rule: [] for rule in DP_RANK_POLICIES}
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
            for rule, (_, url) in routers.items():  # warm-up: the workers in rotation, connections open
                await asyncio.gather(*(one(session, url, 0.0, time.perf_counter(), body) for _, body in work[:4]))
            for rnd in range(args.rounds):
                order = list(DP_RANK_POLICIES) if rnd % 2 == 0 else list(reversed(DP_RANK_POLICIES))
                for rule in order:
                    per_rule[rule].append(await run_rule(routers[rule][1], decode, work, session))
    finally:
        for runner, _ in routers.values():
            await runner.cleanup()
        await prefill.close()
        await decode.close()
    summary: dict = {"bench": "dp_routing", "requests": args.requests, "rate": args.rate, "rounds": args.rounds,
                     "long_share": args.long_share, "rank_token_budget": args.rank_token_budget}
    for rule, runs in per_rule.items():
        for key in runs[0]:
            summary[f"{rule}_{key}"] = round(statistics.median(r[key] for r in runs), 3)
    for key in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "busier_share_p50", "time_over_1_5x"):
        least = summary[f"least_tokens_{key}"]
        summary[f"rr_over_least_{key}"] = round(summary[f"round_robin_{key}"] / least, 3) if least else None
    return summary


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
