"""Router overhead: pdserve's router side by side with sglang-router on the same stand-in workers.

Starts one stand-in prefill and one stand-in decode worker (each its own
process, answering at once), the pdserve router and sglang-router
(``--pd-disaggregation``) in front of them, and measures for short
non-streamed and streamed ``/generate`` requests:

- latency at concurrency 1 (p50, p99) through each router and directly to the
  decode worker (the baseline: "added" latency = router - direct), the three
  taking turns request by request;
- the request rate at saturation (closed loop, ``--concurrency`` clients), and
  the router process's CPU time per request meanwhile (insensitive to noise:
  on a small machine the stand-ins and the client, not the router, saturate).

Saturation runs alternate between the routers (median of ``--rounds``). Ends
with ONE JSON line holding both routers' figures and the ratios. Fixed seed.

``--traced`` adds the same pdserve router with ``--enable-trace`` (ratio 1.0) exporting to an OTLP/HTTP
receiver of its own process (``tests/support/otlp_receiver.py``); ``{kind}_vs_traced_rps`` is the
untraced router's request rate over the traced one's (the stand-ins do not trace: the router's cost alone).

``--baseline-tree DIR`` adds the pdserve router of another checkout (``git worktree add DIR
REV``) as a third router, and ``--baseline-rev REV`` that of a revision of this one, measured in
the same run; the ``vs_baseline`` ratios compare this tree's with it. Each saturation ratio is
also given per round (the routers take turns within a round) as ``{ratio}_median``, ``_min`` and
``_max``: on a shared machine, the median with its spread is the figure to report.

    .venv/bin/python scripts/bench_router.py [--requests 400] [--duration 3] [--rounds 2] [--concurrency 32]
                                             [--baseline-tree DIR | --baseline-rev REV] [--no-sglang] [--traced]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package: benchlib by path

from benchlib.ab_rounds import round_ratios  # noqa: E402
from benchlib.revision_tree import checkout_tree, revision_tree  # noqa: E402

from pdserve.entrypoints.procs import free_port, spawn, stop_groups  # noqa: E402

PY = sys.executable
# the stand-in worker is test code (it imports nothing of pdserve): run by path, as its own process
STANDIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support", "standin_worker.py")
RECEIVER = os.path.join(os.path.dirname(STANDIN), "otlp_receiver.py")  # --traced: the collector's stand-in


async def wait_ready(session: aiohttp.ClientSession, url: str, body: dict, timeout: float,
                     procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited with {p.returncode}")
        try:
            async with session.post(url + "/generate", json=body) as r:
                await r.read()
                if r.status == 200:
                    return
                last = r.status
        except aiohttp.ClientError as e:
            last = e
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s: {last}")


async def one(session: aiohttp.ClientSession, url: str, data: bytes, stream: bool) -> float:
    t0 = time.perf_counter()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        if stream:
            async for _ in r.content.iter_any():
                pass
        else:
            await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def latency(session, targets: dict[str, str], data: bytes, stream: bool, n: int):
    """Sequential requests, the targets taking turns request by request (in a shuffled order
    each turn) so that the machine's noise falls on all of them alike."""
    samples = {name: [] for name in targets}
    names = list(targets)
    for _ in range(n):
        random.shuffle(names)
        for name in names:
            samples[name].append(await one(session, targets[name], data, stream))
    return {name: {"p50_ms": 1e3 * pct(s, 0.5), "p99_ms": 1e3 * pct(s, 0.99), "n": len(s)}
            for name, s in samples.items()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def saturation(session, url: str, data: bytes, stream: bool, concurrency: int,
                     duration: float, pid: int) -> tuple[float, float]:
    """(requests per second, router CPU microseconds per request)."""
    done = 0
    cpu0 = cpu_seconds(pid)
    stop_at = time.perf_counter() + duration

    async def worker():
        nonlocal done
        while time.perf_counter() < stop_at:
            await one(session, url, data, stream)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0), 1e6 * (cpu_seconds(pid) - cpu0) / max(done, 1)


async def measure(args, targets: dict[str, str], pids: dict[str, int]) -> dict:
    results = {}
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4,
                                                                  "temperature": 0}}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, auto_decompress=False,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        for stream in (False, True):
            kind = "stream" if stream else "json"
            data = json.dumps({**body, "stream": stream}).encode()
            urls = {name: url + "/generate" for name, url in targets.items()}
            for url in urls.values():  # warm up connections and code paths
                for _ in range(50):
                    await one(session, url, data, stream)
            lat = await latency(session, urls, data, stream, args.requests)
            rate = {name: [] for name in pids}
            for _ in range(args.rounds):
                for name in random.sample(list(rate), len(rate)):
                    rate[name].append(await saturation(session, urls[name], data, stream,
                                                       args.concurrency, args.duration, pids[name]))
            for name, lat_ in lat.items():
                results[f"{kind}.{name}"] = {**lat_}
                if name in rate:
                    results[f"{kind}.{name}"]["rps"] = statistics.median(r for r, _ in rate[name])
                    results[f"{kind}.{name}"]["cpu_us_per_req"] = statistics.median(c for _, c in rate[name])
                    results[f"{kind}.{name}"]["rounds_rps"] = [r for r, _ in rate[name]]
    return results


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400, help="sequential requests per target (latency)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per saturation run")
    p.add_argument("--rounds", type=int, default=2, help="saturation runs per target (median)")
    p.add_argument("--concurrency", type=int, default=32)
    base = p.add_mutually_exclusive_group()
    base.add_argument("--baseline-tree", metavar="DIR",
                      help="also run the pdserve router of this checkout (another commit) as 'baseline'")
    base.add_argument("--baseline-rev", metavar="REV",
                      help="also run the pdserve router of git revision REV of this checkout as 'baseline'")
    p.add_argument("--no-sglang", action="store_true", help="leave sglang-router out")
    p.add_argument("--traced", action="store_true", help="add the pdserve router with --enable-trace")
    p.add_argument("--logs", default="/tmp/bench_router_logs")
    args = p.parse_args()
    random.seed(0)
    os.makedirs(args.logs, exist_ok=True)
    pp, dp, bp = (free_port() for _ in range(3))
    prefill, decode = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    procs = [
        spawn([PY, STANDIN, "--role", "prefill", "--port", str(pp)],
              f"{args.logs}/prefill.log"),
        spawn([PY, STANDIN, "--role", "decode", "--port", str(dp)],
              f"{args.logs}/decode.log"),
    ]
    routers: dict[str, subprocess.Popen] = {}
    targets = {"direct": decode}
    try:
        async def ready_workers():
            async with aiohttp.ClientSession() as s:
                for url in (prefill, decode):
                    await wait_ready(s, url, {"text": "x"}, 30, procs)
        asyncio.run(ready_workers())
        pdserve_args = ["-m", "pdserve.router", "--prefill", prefill, str(bp), "--decode", decode,
                        "--host", "127.0.0.1", "--policy", "round_robin", "--log-level", "warn"]
        runs = [("pdserve", None)]
        if args.baseline_tree or args.baseline_rev:
            dest = f"{args.logs}/baseline_{os.getpid()}"
            if args.baseline_tree:
                path = checkout_tree(args.baseline_tree, dest)
            else:
                repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                path = revision_tree(repo, args.baseline_rev, dest)
            runs.append(("baseline", {**os.environ, "PYTHONPATH": path}))
        for name, env in runs:
            port = free_port()
            routers[name] = spawn([PY, *pdserve_args, "--port", str(port)], f"{args.logs}/{name}_router.log",
                                  env=env)
            targets[name] = f"http://127.0.0.1:{port}"
        if args.traced:
            rp = free_port()
            procs.append(spawn([PY, RECEIVER, "--port", str(rp)], f"{args.logs}/otlp_receiver.log"))
            port = free_port()
            routers["traced"] = spawn([PY, *pdserve_args, "--port", str(port), "--enable-trace",
                                       "--otlp-traces-endpoint", f"127.0.0.1:{rp}", "--trace-sample-ratio", "1.0"],
                                      f"{args.logs}/traced_router.log")
            targets["traced"] = f"http://127.0.0.1:{port}"
        if not args.no_sglang:
            port = free_port()
            routers["sglang"] = spawn(
                [PY, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill, str(bp),
                 "--decode", decode, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                 "--log-level", "warn", "--prometheus-port", str(free_port())], f"{args.logs}/sglang_router.log")
            targets["sglang"] = f"http://127.0.0.1:{port}"
        procs.extend(routers.values())

        async def run():
            async with aiohttp.ClientSession() as s:
                for name in routers:
                    await wait_ready(s, targets[name], {"text": "x"}, 120, procs)
            return await measure(args, targets, {name: proc.pid for name, proc in routers.items()})

        results = asyncio.run(run())
    finally:
        stop_groups(procs, grace=10.0)

    summary = {"bench": "router", "cpus": os.cpu_count(), "concurrency": args.concurrency}
    print(f"{'mode':7} {'target':8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} "
          f"{'req/s':>8} {'CPU us/req':>10}")
    for kind in ("json", "stream"):
        direct = results[f"{kind}.direct"]
        for name in targets:
            r = results[f"{kind}.{name}"]
            if name != "direct":
                r["added_p50_ms"] = r["p50_ms"] - direct["p50_ms"]
                r["added_p99_ms"] = r["p99_ms"] - direct["p99_ms"]
            print(f"{kind:7} {name:8} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} "
                  f"{r.get('added_p50_ms', 0):10.3f} {r.get('added_p99_ms', 0):10.3f} "
                  f"{r.get('rps', float('nan')):8.0f} {r.get('cpu_us_per_req', float('nan')):10.0f}")
            rounds_rps = r.pop("rounds_rps", None)
            summary[f"{kind}_{name}"] = {k: round(v, 4) for k, v in r.items()}
            if rounds_rps is not None:
                summary[f"{kind}_{name}"]["rounds_rps"] = [round(x, 1) for x in rounds_rps]
        for other, label in (("sglang", "ratio"), ("baseline", "vs_baseline"), ("traced", "vs_traced")):
            if other not in targets:
                continue
            ours_, theirs_ = results[f"{kind}.pdserve"], results[f"{kind}.{other}"]
            summary[f"{kind}_{label}_added_p50"] = round(
                ours_["added_p50_ms"] / max(theirs_["added_p50_ms"], 1e-6), 3)
            summary[f"{kind}_{label}_added_p99"] = round(
                ours_["added_p99_ms"] / max(theirs_["added_p99_ms"], 1e-6), 3)
            summary[f"{kind}_{label}_rps"] = round(ours_["rps"] / theirs_["rps"], 3)
            # round by round (the routers took turns within each round): a rate is a speed
            per_round = round_ratios([1 / x for x in summary[f"{kind}_pdserve"]["rounds_rps"]],
                                     [1 / x for x in summary[f"{kind}_{other}"]["rounds_rps"]])
            for stat, v in per_round.items():
                summary[f"{kind}_{label}_rps_{stat}"] = round(v, 3)
            print(f"{kind:7} rps pdserve/{other}: {summary[f'{kind}_{label}_rps']:.3f} (median of rounds "
                  f"{per_round['median']:.3f}, {per_round['min']:.3f}-{per_round['max']:.3f})")
            summary[f"{kind}_{label}_cpu_per_req"] = round(ours_["cpu_us_per_req"] / theirs_["cpu_us_per_req"], 3)
    if "sglang" in targets:
        summary["targets_met"] = all(summary[f"{k}_ratio_added_p50"] <= 1.5 and summary[f"{k}_ratio_rps"] >= 0.5
                                     for k in ("json", "stream"))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
