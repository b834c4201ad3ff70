"""Tenant fairness at the router: a quiet tenant's TTFT while another floods, fair sharing against FIFO.

Two stand-in workers (tests/support/standin_worker.py, in this process: the decode one answers
each request after ``--service-ms``, its first streamed event included) behind two pdserve routers
(each its own process) whose ``--max-concurrent-requests`` is the fleet's capacity: ``fifo`` with
no tenant flags (today's one queue) and ``fair`` with ``--tenant-header`` and a tenant file giving
tenants ``a`` and ``b`` weight 1. Open-loop Poisson arrivals (fixed seed), streamed ``/generate``;
TTFT is the time to the first streamed bytes at the client. Three phases, in one invocation:

- ``solo``: tenant b alone at ``--b-load`` of its share (its share: half the capacity; at a whole
  share b's own queue would be critically loaded whenever a keeps the other half busy), through
  the fair router;
- ``fifo``: b as in solo and a at ``--flood`` times b's share, through the fifo router;
- ``fair``: the same arrivals through the fair router;
- ``slo``: the same arrivals through a router with ``--slo-ttft-ms --slo-ms`` (reject, no tenants).

Ends with one JSON line: b's p50 TTFT per phase, the ratios fair/solo and fifo/fair, each
tenant's answers by status, and goodput (answers whose TTFT met ``--slo-ms``, per second of
arrivals) of the fifo and slo phases with their ratio.

    .venv/bin/python scripts/bench_tenants.py [--duration 10] [--slots 2] [--service-ms 200] [--flood 10]
                                              [--b-load 0.5] [--slo-ms 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))  # the stand-in worker: test code, by path

from standin_worker import Behavior, StandinWorker  # noqa: E402

from pdserve.entrypoints.procs import free_port, spawn, stop_groups  # noqa: E402

PY = sys.executable
HEADER = "x-tenant"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def one(session: aiohttp.ClientSession, url: str, tenant: str, i: int) -> tuple[str, int, float | None]:
    """(tenant, HTTP status, TTFT in s or None when refused)"""
    body = {"text": f"{tenant}-{i:06d} tell me a story", "stream": True, "sampling_params": {"max_new_tokens": 8}}
    t0 = time.perf_counter()
    async with session.post(url + "/generate", json=body, headers={HEADER: tenant}) as r:
        if r.status != 200:
            await r.read()
            return tenant, r.status, None
        await r.content.readany()
        ttft = time.perf_counter() - t0
        async for _ in r.content.iter_any():
            pass
        return tenant, r.status, ttft


async def phase(session, url: str, rates: dict[str, float], duration: float, seed: int, slo_ms: float) -> dict:
    """Poisson arrivals of each tenant at its rate for ``duration`` seconds; every answer awaited."""
    rng = random.Random(seed)
    arrivals = []
    for tenant, rate in rates.items():
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= duration:
                break
            arrivals.append((t, tenant))
    arrivals.sort()
    tasks = []
    t0 = time.perf_counter()
    for i, (at, tenant) in enumerate(arrivals):
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(session, url, tenant, i)))
    results = await asyncio.gather(*tasks)
    out = {}
    for tenant in rates:
        mine = [r for r in results if r[0] == tenant]
        ttfts = [r[2] for r in mine if r[2] is not None]
        out[tenant] = {"sent": len(mine), "status": dict(Counter(str(r[1]) for r in mine)),
                       "ttft_p50_ms": 1e3 * pct(ttfts, 0.5), "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
                       "within_slo": sum(t * 1e3 <= slo_ms for t in ttfts)}
    out["goodput_rps"] = sum(t["within_slo"] for t in out.values()) / duration
    return out


async def wait_ready(session: aiohttp.ClientSession, url: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited with {p.returncode}")
        try:
            async with session.get(url + "/readiness") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


async def run(args) -> dict:
    prefill = StandinWorker("prefill", Behavior(record=False))
    decode = StandinWorker("decode", Behavior(record=False, delay_s=args.service_ms / 1000.0))
    await prefill.start()
    await decode.start()
    logs = tempfile.mkdtemp(prefix="bench_tenants_")
    tenants = os.path.join(logs, "tenants.yaml")
    with open(tenants, "w") as f:
        f.write("tenants:\n  a: {weight: 1}\n  b: {weight: 1}\n")
    common = ["-m", "pdserve.router", "--prefill", prefill.url, "none", "--decode", decode.url,
              "--host", "127.0.0.1", "--policy", "round_robin", "--log-level", "warn",
              "--max-concurrent-requests", str(args.slots), "--queue-size", str(args.queue_size),
              "--queue-timeout-secs", "120"]
    urls, procs = {}, []
    for name, extra in (("fifo", []), ("fair", ["--tenant-header", HEADER, "--tenant-config", tenants]),
                        ("slo", ["--slo-ttft-ms", str(args.slo_ms), "--slo-miss-policy", "reject"])):
        port = free_port()
        procs.append(spawn([PY, *common, "--port", str(port), *extra], f"{logs}/{name}_router.log"))
        urls[name] = f"http://127.0.0.1:{port}"
    try:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            for url in urls.values():
                await wait_ready(s, url, procs)
            share = args.slots / (args.service_ms / 1000.0) / 2  # b's share: half the capacity
            b_rate = share * args.b_load
            both = {"a": share * args.flood, "b": b_rate}
            results = {
                "solo": await phase(s, urls["fair"], {"b": b_rate}, args.duration, 1, args.slo_ms),
                "fifo": await phase(s, urls["fifo"], both, args.duration, 2, args.slo_ms),
                "fair": await phase(s, urls["fair"], both, args.duration, 2, args.slo_ms),
                "slo": await phase(s, urls["slo"], both, args.duration, 2, args.slo_ms),
            }
    finally:
        stop_groups(procs, grace=10.0)
        await prefill.close()
        await decode.close()
    b = {name: results[name]["b"]["ttft_p50_ms"] for name in ("solo", "fifo", "fair")}
    return {"bench": "tenants", "cpus": os.cpu_count(), "slots": args.slots, "service_ms": args.service_ms,
            "b_rate": b_rate, "a_rate": share * args.flood, "duration_s": args.duration,
            "b_p50_ttft_ms": b, "b_fair_over_solo": b["fair"] / b["solo"], "b_fifo_over_fair": b["fifo"] / b["fair"],
            "goodput_rps": {name: r["goodput_rps"] for name, r in results.items()},
            "goodput_slo_over_fifo": results["slo"]["goodput_rps"] / max(results["fifo"]["goodput_rps"], 1e-9),
            "phases": results}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per phase")
    p.add_argument("--slots", type=int, default=2, help="the routers' --max-concurrent-requests (capacity)")
    p.add_argument("--service-ms", type=float, default=200.0, help="the decode stand-in's time per request")
    p.add_argument("--flood", type=float, default=10.0, help="tenant a's rate over b's share (half the capacity)")
    p.add_argument("--b-load", type=float, default=0.5, help="tenant b's rate over its share")
    p.add_argument("--queue-size", type=int, default=100)
    p.add_argument("--slo-ms", type=float, default=1000.0, help="the TTFT target of the slo phase and of goodput")
    args = p.parse_args()
    summary = asyncio.run(run(args))
    for name, r in summary["phases"].items():
        for tenant, t in r.items():
            if tenant == "goodput_rps":
                continue
            print(f"{name:5} {tenant} sent {t['sent']:5d} status {t['status']} "
                  f"ttft p50 {t['ttft_p50_ms']:8.1f} ms p99 {t['ttft_p99_ms']:8.1f} ms within slo {t['within_slo']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
