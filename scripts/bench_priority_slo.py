"""Interactive goodput on a shared 1P1D cluster at 1.5x its capacity: a router with priorities and
SLO admission against a FIFO router, over the same servers, in one invocation.

Starts one prefill and one decode server (the default model, bf16, Mooncake TCP, one thread each,
``--enable-priority-scheduling``) and two routers in front of them, each capped at
``--max-concurrent-requests`` in flight with the rest queued:

- ``fifo``: one queue in arrival order (no ``--enable-priority-scheduling``);
- ``priority+slo``: ``--enable-priority-scheduling --slo-ttft-ms S --slo-miss-policy deprioritize``:
  the queue by priority, and a request whose estimated TTFT misses S sent after every other.

Each round first measures the cluster's capacity (requests per second with the cap's worth in
flight, through the FIFO router: a shared machine's speed moves between rounds), then sends the
same Poisson workload at ``--load`` x that capacity through one router, then the other (the order
swapped every round), with
``scripts/bench_serving.py``: ``--priority-mix`` of interactive requests (priority 10) among batch
requests (priority 0), the same lengths. Reported per router: the interactive requests' goodput
(TTFT within ``--slo-ttft-ms`` and TPOT within ``--slo-tpot-ms``, per second) and p50 TTFT, and
the batch requests' completions; the ratio is the median of the rounds' priority+slo / fifo
interactive goodput. Aim: >= 2x.

    .venv/bin/python scripts/bench_priority_slo.py [--rounds 2] [--num-prompts 200] [--load 1.5]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # benchlib by path: scripts/ is not a package

from pdserve.entrypoints.procs import free_port, spawn, stop_group, wait_healthy  # noqa: E402

PY = sys.executable
INTERACTIVE, BATCH = "10", "0"


def start(name: str, cmd: list[str], logs: str, url: str, procs: list) -> None:
    proc = spawn([PY, *cmd], f"{logs}/{name}.log", cwd=REPO)
    procs.append(proc)
    wait_healthy(url, proc, 900, name=name, log=lambda: f"see {logs}/{name}.log", period=0.5)


def bench(url: str, args, out: str, rate: str, num_prompts: int, mix: bool, prioritised: bool = False) -> dict:
    """One bench_serving run against ``url``; its JSON line."""
    cmd = [PY, str(REPO / "scripts/bench_serving.py"), "--base-url", url, "--backend", "generate",
           "--dataset", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "1", "--num-prompts", str(num_prompts),
           "--request-rate", rate, "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
           "--seed", str(args.seed), "--output-file", out, "--warmup-requests", "0"]
    if mix:
        cmd += ["--priority-mix", f"{INTERACTIVE}:{args.interactive},{BATCH}:{1 - args.interactive}"]
        if not prioritised:  # the FIFO router refuses the header; the servers still read the body's
            cmd.append("--no-priority-header")
    else:
        cmd += ["--max-concurrency", str(args.max_concurrent_requests)]
    if os.path.exists(out):
        os.unlink(out)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"bench_serving.py failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return json.loads(Path(out).read_text().strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=2)
    # long enough that FIFO's queue wait passes the SLO for most of the run (at 1.5x it grows by a third
    # of the arrivals): a short burst ends before any queue builds on a fast machine
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--load", type=float, default=1.5, help="offered rate over the measured capacity")
    ap.add_argument("--interactive", type=float, default=0.3, help="the fraction of interactive requests")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--slo-ttft-ms", type=float, default=3000)
    ap.add_argument("--slo-tpot-ms", type=float, default=500)
    ap.add_argument("--max-concurrent-requests", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    logs = tempfile.mkdtemp(prefix="bench-priority-slo-")
    procs: list = []
    try:
        ports = {k: free_port() for k in ("P", "boot", "D", "fifo", "prio")}
        server = ["-m", "pdserve.engine", "--dtype", "bfloat16", "--num-threads", "1", "--log-level", "warning",
                  "--max-total-tokens", "8192", "--disaggregation-transfer-backend", "mooncake",
                  "--enable-priority-scheduling"]
        p_url, d_url = f"http://127.0.0.1:{ports['P']}", f"http://127.0.0.1:{ports['D']}"
        start("prefill", [*server, "--port", str(ports["P"]), "--disaggregation-mode", "prefill",
                          "--disaggregation-bootstrap-port", str(ports["boot"])], logs, p_url, procs)
        start("decode", [*server, "--port", str(ports["D"]), "--disaggregation-mode", "decode"], logs, d_url, procs)
        router = ["-m", "pdserve.router", "--prefill", p_url, str(ports["boot"]), "--decode", d_url,
                  "--max-concurrent-requests", str(args.max_concurrent_requests), "--queue-size", "1000",
                  "--queue-timeout-secs", "600", "--log-level", "warning"]
        urls = {"fifo": f"http://127.0.0.1:{ports['fifo']}", "priority+slo": f"http://127.0.0.1:{ports['prio']}"}
        start("router-fifo", [*router, "--port", str(ports["fifo"])], logs, urls["fifo"], procs)
        start("router-prio", [*router, "--port", str(ports["prio"]), "--enable-priority-scheduling",
                              "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-miss-policy", "deprioritize"],
              logs, urls["priority+slo"], procs)

        out = f"{logs}/bench.jsonl"
        rows: dict[str, list[dict]] = {name: [] for name in urls}
        ratios, rates = [], []
        for r in range(args.rounds):
            cap = bench(urls["fifo"], args, out, "inf", 4 * args.max_concurrent_requests, mix=False)
            rate = args.load * cap["request_throughput"]
            rates.append(rate)
            print(f"round {r}: capacity {cap['request_throughput']:.3f} req/s (the cap's worth in flight); "
                  f"offered {rate:.3f} req/s", flush=True)
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            got = {}
            for name in order:
                line = bench(urls[name], args, out, f"{rate:.4f}", args.num_prompts, mix=True,
                             prioritised=name != "fifo")
                groups = line["by_priority"]
                inter, batch = groups[INTERACTIVE], groups[BATCH]
                got[name] = {"interactive_goodput": inter["goodput"],
                             "interactive_p50_ttft_ms": inter.get("median_ttft_ms"),
                             "interactive_completed": inter.get("completed"),
                             "batch_completed": batch.get("completed"), "failed": line.get("failed")}
                rows[name].append(got[name])
                print(f"round {r} {name:13s}: interactive goodput {inter['goodput']:.3f} req/s, p50 TTFT "
                      f"{inter.get('median_ttft_ms', float('nan')):.0f} ms, completed {inter.get('completed')}; "
                      f"batch completed {batch.get('completed')}", flush=True)
            base = got["fifo"]["interactive_goodput"]
            ratios.append(got["priority+slo"]["interactive_goodput"] / base if base else float("inf"))
        ratio = statistics.median(ratios)
        print(f"interactive goodput priority+slo / fifo: median {ratio:.2f} over {args.rounds} rounds "
              f"({', '.join(f'{x:.2f}' for x in ratios)}); aim >= 2", flush=True)
        print(json.dumps({"offered_rps": rates, "rounds": rows, "ratios": ratios,
                          "ratio": ratio, "args": vars(args)}))
    finally:
        for proc in reversed(procs):
            stop_group(proc, grace=20.0)


if __name__ == "__main__":
    main()
