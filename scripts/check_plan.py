"""``pdserve plan``'s predictions against a real run of the same configuration.

Starts one prefill and one decode server and the router (``pdserve launch --cpu-split auto``:
one core each on a 2-core machine, as the profile was taken with ``--cpus 1``), checks that the
servers match the profile, sends a Poisson load of fixed-length random prompts through the router
(streaming ``/generate``, ``ignore_eos``), and compares the measured TTFT (p50, p95) and mean ITL
with what the advisor's models predict from the profile for that traffic and counts. Ends with one
JSON line (predicted, measured, relative error).

    python scripts/check_plan.py --rate 0.4 --input-len 256 --output-len 32 --duration 90
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

from pdserve.entrypoints.cluster import Cluster, LaunchConfig
from pdserve.entrypoints.planner import profile as prof
from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel
from pdserve.entrypoints.planner.profiler import SHORT, TOKEN_ID_RANGE, describe, measure, stream_times
from pdserve.entrypoints.planner.scaling import Load, predict_itl, predict_ttft
from pdserve.entrypoints.procs import get_json

HERE = os.path.dirname(os.path.abspath(__file__))


async def one(session, url, ids, tokens, out):
    t0 = time.perf_counter()
    try:
        times = await stream_times(session, url, ids, tokens)
    except RuntimeError:
        times = []
    if len(times) < 2:
        out.append(None)
        return
    out.append((times[0] - t0, (times[-1] - times[0]) / (len(times) - 1)))


async def load(url, rate, isl, osl, duration, seed):
    rng = random.Random(seed)
    out, tasks = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        t_end = time.monotonic() + duration
        while time.monotonic() < t_end:
            ids = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(isl)]
            tasks.append(asyncio.ensure_future(one(session, url, ids, osl, out)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return out


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=os.path.join(HERE, "..", "results", "planner_profile_smollm2_cpu.json"))
    p.add_argument("--rate", type=float, default=0.4)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh-profile", default=None, metavar="JSON",
                   help="measure a profile first, through the router of the cluster it starts (pdserve profile "
                        "--mode short --url ROUTER: the PD path, KV transfer and the decode server's first step "
                        "included), into this file, and predict from it: the machine as it is now")
    ns = p.parse_args()
    profile = prof.load(ns.profile)
    mtt = profile.server.max_total_tokens
    cluster = Cluster(LaunchConfig(prefill=1, decode=1, port=0, cpu_split="auto",
                                   engine_args=("--max-total-tokens", str(mtt)) if mtt else ()))
    try:
        cluster.start()
        cluster.wait_ready()
        if ns.fresh_profile:
            server, prefill, decode = asyncio.run(measure(cluster.url, SHORT, ns.seed))
            profile = prof.new_profile(server, prefill, decode, note="pdserve profile --mode short --url ROUTER "
                                                                      "(1 prefill + 1 decode, --cpu-split auto)")
            prof.save(profile, ns.fresh_profile)
            ns.profile = ns.fresh_profile
        for spec in cluster.specs[:2]:
            prof.check_matches(profile, describe(get_json(spec.url + "/get_server_info", timeout=10)), ns.profile)
        pm, dm = PrefillModel(profile), DecodeModel(profile)
        traffic = Load(ns.rate, ns.input_len, ns.output_len)
        predicted = {"ttft_p50_s": predict_ttft(pm, traffic, 1, quantile=0.5),
                     "ttft_p95_s": predict_ttft(pm, traffic, 1, quantile=0.95),
                     "itl_mean_s": predict_itl(dm, traffic, 1)[0]}
        t0 = time.time()
        out = asyncio.run(load(cluster.url, ns.rate, ns.input_len, ns.output_len, ns.duration, ns.seed))
    finally:
        cluster.stop()
    ok = [o for o in out if o is not None]
    ttfts = sorted(o[0] for o in ok)
    measured = {"ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": ttfts[int(0.95 * (len(ttfts) - 1))],
                "itl_mean_s": statistics.mean(o[1] for o in ok)}
    error = {k: round(predicted[k] / measured[k] - 1, 3) for k in predicted}
    line = {"check": "plan_vs_real", "requests": len(out), "failed": len(out) - len(ok), "rate": ns.rate,
            "input_len": ns.input_len, "output_len": ns.output_len, "counts": "1 prefill + 1 decode",
            "predicted": {k: round(v, 4) for k, v in predicted.items()},
            "measured": {k: round(v, 4) for k, v in measured.items()}, "relative_error": error,
            "load_avg_1m": round(os.getloadavg()[0], 2), "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
