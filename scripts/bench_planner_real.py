"""The planner on real servers under a stepped load: ``pdserve launch
--planner`` (1 prefill + 1 decode + router, the planner with the ``local`` connector in the launch
process) and a load of low, high, low request rates. Samples the planner's own ``/metrics``
(servers per role and state) every 2 s, plots rate, servers per role and p99 TTFT / ITL over
time (PNG) and ends with one JSON line (requests, failed requests, the planner's scale events).

The servers run as the shipped profile was taken (one thread each, the same KV size), so the
planner's profile check passes.

    python scripts/bench_planner_real.py --low 0.2 --high 2.0 --steps 45,120,120 --input-len 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import urllib.request

import aiohttp

from pdserve.entrypoints.procs import free_port, get_json, log_tail, spawn, stop_group
from pdserve.entrypoints.planner import profile as prof
from pdserve.entrypoints.planner.profiler import TOKEN_ID_RANGE, stream_times

HERE = os.path.dirname(os.path.abspath(__file__))


async def one(session, url, ids, tokens, rec):
    t0, start = time.monotonic(), time.perf_counter()
    try:
        times = await stream_times(session, url, ids, tokens)
        ok = len(times) == tokens
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
        times, ok = [], False
    rec.append({"t": t0, "ok": ok, "ttft": times[0] - start if times else None,
                "itl": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None})


def p99(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else None


def servers(planner: str) -> dict:
    """{role: {state: n}} from the planner's pdserve_planner_servers gauge."""
    out = {"prefill": {}, "decode": {}}
    with urllib.request.urlopen(planner + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pdserve_planner_servers{"):
                labels, value = line[len("pdserve_planner_servers{"):].split("} ")
                kv = dict(x.split("=") for x in labels.split(","))
                out[kv["role"].strip('"')][kv["state"].strip('"')] = float(value)
    return out


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=os.path.join(HERE, "..", "results", "planner_profile_smollm2_cpu.json"))
    p.add_argument("--low", type=float, default=0.2, help="req/s")
    p.add_argument("--high", type=float, default=2.0, help="req/s")
    p.add_argument("--steps", default="45,120,120", help="seconds of low, high, low")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--ttft-slo", type=float, default=3.0)
    p.add_argument("--itl-slo", type=float, default=0.1)
    p.add_argument("--out-dir", default="/tmp/bench_planner_real")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    os.makedirs(ns.out_dir, exist_ok=True)
    profile = prof.load(ns.profile)
    s = profile.server
    serve = ["--num-threads", str(s.num_threads or 1), "--max-total-tokens", str(s.max_total_tokens)]
    steps = [float(x) for x in ns.steps.split(",")]
    rates = [ns.low, ns.high, ns.low]
    port, planner_port = free_port(), free_port()
    url, planner = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{planner_port}"
    argv = [sys.executable, "-m", "pdserve.entrypoints.cli", "launch", "--prefill", "1", "--decode", "1",
            "--port", str(port), "--log-dir", ns.out_dir, *serve, "--planner", "--planner-port", str(planner_port),
            f"--planner-arg=--profile={ns.profile}", f"--planner-arg=--ttft-slo={ns.ttft_slo}",
            f"--planner-arg=--itl-slo={ns.itl_slo}", "--planner-arg=--adjustment-interval=10",
            "--planner-arg=--cooldown=30", "--planner-arg=--max-prefill=2", "--planner-arg=--max-decode=2",
            "--planner-arg=--drain-timeout=120"]
    print("$ pdserve " + " ".join(argv[3:]), flush=True)
    launch_log = os.path.join(ns.out_dir, "launch.out")
    samples, rec = [], []

    async def run():
        stop = asyncio.Event()
        rng = random.Random(ns.seed)
        t_start = time.monotonic()

        async def sampler():
            while not stop.is_set():
                st = await asyncio.to_thread(servers, planner)
                if not st["prefill"]:  # the planner's first poll has not set its gauges yet
                    await asyncio.sleep(0.5)
                    continue
                samples.append({"t": time.monotonic() - t_start,
                                **{r: sum(v for k, v in st[r].items() if k in ("external", "starting", "ready"))
                                   for r in ("prefill", "decode")},
                                **{f"ready_{r}": st[r].get("external", 0) + st[r].get("ready", 0)
                                   for r in ("prefill", "decode")}})
                await asyncio.sleep(2)

        sampling = asyncio.ensure_future(sampler())
        tasks = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for rate, dur in zip(rates, steps):
                end = time.monotonic() + dur
                while time.monotonic() < end:
                    ids = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(ns.input_len)]
                    tasks.append(asyncio.ensure_future(one(session, url, ids, ns.output_len, rec)))
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
            await asyncio.sleep(40)  # the scale-down after the last step
        stop.set()
        await sampling
        return t_start

    t0 = time.time()
    launch = spawn(argv, launch_log, die_with_parent=True)
    try:
        while get_json(planner + "/health", timeout=2) is None:  # launch starts the planner once ready
            if launch.poll() is not None:
                raise SystemExit("pdserve launch --planner exited:\n" + log_tail(launch_log))
            time.sleep(1)
        t_start = asyncio.run(run())
        decisions = get_json(planner + "/decisions", timeout=10)
        launch.send_signal(signal.SIGTERM)
        launch_rc = launch.wait(60)
    finally:
        stop_group(launch)
    windows = {}
    for r in rec:
        windows.setdefault(int((r["t"] - t_start) // 10), []).append(r)
    series = [{"t": k * 10, "rate": len(v) / 10, "ttft_p99": p99([r["ttft"] for r in v]),
               "itl_p99": p99([r["itl"] for r in v])} for k, v in sorted(windows.items())]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    a.plot([x["t"] for x in series], [x["rate"] for x in series], color="gray")
    a.set_ylabel("arrivals (req/s)")
    a.set_title(f"pdserve launch --planner under a stepped load; SLO TTFT {ns.ttft_slo} s, "
                f"ITL {ns.itl_slo} s", fontsize=9)
    b.step([x["t"] for x in samples], [x["prefill"] for x in samples], where="post", label="prefill (asked for)")
    b.step([x["t"] for x in samples], [x["decode"] for x in samples], where="post", label="decode (asked for)")
    b.step([x["t"] for x in samples], [x["ready_prefill"] for x in samples], where="post", label="prefill (serving)",
           ls=":")
    b.step([x["t"] for x in samples], [x["ready_decode"] for x in samples], where="post", label="decode (serving)",
           ls="--")
    b.set_ylabel("servers")
    b.legend(fontsize=8)
    c.plot([x["t"] for x in series], [x["ttft_p99"] for x in series], label="p99 TTFT (s)")
    c.plot([x["t"] for x in series], [x["itl_p99"] * 10 if x["itl_p99"] else None for x in series],
           label="p99 ITL (x10 s)")
    c.set_ylabel("seconds")
    c.set_xlabel("time (s)")
    c.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(ns.out_dir, "bench_planner_real.png")
    fig.savefig(png, dpi=100)
    events = {f"{r}_scale_{d}s": sum(1 for a_, b_ in zip(decisions, decisions[1:])
                                      if (b_["target"][r] - a_["target"][r]) * (1 if d == "up" else -1) > 0)
              for r in ("prefill", "decode") for d in ("up", "down")}
    line = {"bench": "planner_real", "requests": len(rec), "failed": sum(1 for r in rec if not r["ok"]),
            "low": ns.low, "high": ns.high, "steps_s": steps, **events,
            "max_prefill": max(x["prefill"] for x in samples), "max_decode": max(x["decode"] for x in samples), "ttft_p99_s": p99([r["ttft"] for r in rec]),
            "itl_p99_s": p99([r["itl"] for r in rec]), "launch_exit": launch_rc, "plot": png, "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(line))
    return 0 if line["failed"] == 0 and launch_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
