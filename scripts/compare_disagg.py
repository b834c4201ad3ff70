"""Disaggregated (1 prefill + 1 decode behind the router, with and without local prefill) against
colocated, same workload, one run.

    .venv/bin/python scripts/compare_disagg.py --quick          # a few minutes
    .venv/bin/python scripts/compare_disagg.py --rates 0.5 1 2 3 --slo-tpot-ms 100

(a) ``colocated``: one ``pdserve serve`` (``--disaggregation-mode null``) using every core.
(b) ``1p1d``: ``pdserve launch --prefill 1 --decode 1 --cpu-split auto`` (each server pinned to
    its own half of the cores, torch threads sized to match), measured through the router.
(c) ``1p1d+local``: (b) with conditional disaggregation: the router's prefill policy is
    ``kv_aware`` with ``--local-prefill-max-tokens N`` and the decode server prefills prompts up
    to N tokens itself (``--max-local-prefill-tokens N``, a mixed chunk of its running batch);
    N is ``--local-prefill-max-tokens`` here (default 256).
The script starts and stops each itself, one after the other (never together: they would
share the cores), and sends each the same rows at the same arrival times.

Workloads:
  steady  random prompts (``--steady-input-len`` tokens, ``--steady-output-len`` out,
          lengths uniform down to half), Poisson arrivals at each rate of the sweep.
  mixed   decode-heavy streams (``--stream-input-len`` in, ``--stream-output-len`` out)
          arriving Poisson at each rate, plus one long prompt (``--long-input-len`` tokens,
          2 tokens out) every ``--long-period`` seconds: on a colocated server every long prefill stalls the
          decode steps of every running stream (the interference disaggregation removes).
  interference  short chats (``--short-input-len`` in, ``--short-output-len`` out) arriving
          Poisson at each rate, plus one long prompt (``--interference-long-len`` tokens, lengths
          uniform down to 3/4 of it, ``--interference-long-output-len`` out) every
          ``--interference-period`` seconds: through 1p1d the short prompts queue behind long
          prefills on the prefill server, which local prefill avoids. Its table reports the short
          requests' p50 TTFT and p99 TPOT, and goodput of all requests. Before its sweep each setup
          gets a few short and long prompts one at a time (idle TTFT, printed and in the JSON);
          its comparison rate is the lowest at which 1p1d's short p50 TTFT is at least twice
          its idle value.

Outputs: a table per rate, a ratio table (1p1d / colocated, 1p1d+local / colocated and
1p1d+local / 1p1d) at the comparison rate (interference: see above; otherwise the
lowest rate at which the colocated server's p99 TPOT exceeds the SLO, else the highest),
``compare_disagg.png`` (goodput and p99 TPOT against rate, both setups, each workload)
and ``tpot_cdf_<workload>.png`` at the comparison rate in ``--out-dir``, and ONE JSON line
on stdout (also appended to ``--output-file``). Goodput counts requests meeting
``--slo-ttft-ms`` and ``--slo-tpot-ms`` together. Fixed seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

from bench_serving import arrival_offsets, benchmark  # noqa: E402
from benchlib import datasets  # noqa: E402
from benchlib.client import BACKENDS  # noqa: E402
from benchlib.metrics import calculate_metrics  # noqa: E402
from benchlib.stand_args import add_stand_args  # noqa: E402

from pdserve.entrypoints.cluster import Cluster, LaunchConfig  # noqa: E402
from pdserve.entrypoints.procs import free_port, log_tail, spawn, stop_group, wait_healthy  # noqa: E402

SETUPS = ("colocated", "1p1d", "1p1d+local")
INTERFERENCE_LONG_RATIO = 0.75  # interference's long prompts: lengths uniform from 3/4 of the flag's
IDLE_PROBES = (4, 2)  # short and long prompts sent one at a time before an interference sweep
LENGTHS = (  # flag, default, --quick default (tokens)
    ("steady_input_len", 256, 128),
    ("steady_output_len", 32, 16),
    ("stream_input_len", 32, 32),
    ("stream_output_len", 64, 32),
    ("long_input_len", 1024, 512),
    ("short_input_len", 64, 64),
    ("short_output_len", 32, 32),
    ("interference_long_len", 2000, 2000),
    ("interference_long_output_len", 8, 8),
)
WORKLOADS = ("steady", "mixed", "interference")
# the workload whose short requests' own metrics are reported beside everyone's
SHORT_KINDS = {"mixed": "stream", "interference": "short"}
TABLE_KEYS = (  # (label, metric key, higher is better)
    ("p50 TTFT ms", "median_ttft_ms", False),
    ("p99 TTFT ms", "p99_ttft_ms", False),
    ("p50 TPOT ms", "median_tpot_ms", False),
    ("p99 TPOT ms", "p99_tpot_ms", False),
    ("throughput req/s", "request_throughput", True),
    ("output tok/s", "output_throughput", True),
    ("goodput req/s", "goodput", True),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two rates, few requests: a few minutes")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--local-prefill-max-tokens", type=int, default=256,
                   help="1p1d+local: the router's --local-prefill-max-tokens and the decode server's "
                        "--max-local-prefill-tokens")
    p.add_argument("--interference-period", type=float, default=2.0,
                   help="seconds between long prompts (interference)")
    p.add_argument("--rates", nargs="+", type=float, default=None,
                   help="request rates (req/s) of the sweep; default 0.5 1 2 3 (quick: 0.5 1.5)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run (mixed: streams); default 40 (quick: 12)")
    for name, full, quick in LENGTHS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {full} (quick: {quick})")
    p.add_argument("--long-period", type=float, default=None,
                   help="seconds between long prompts (mixed); default 3 (quick: 4)")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="generate")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of every server")
    p.add_argument("--engine-args", default="",
                   help="more flags for every engine server of every setup, one shell-quoted string after '=' (e.g. "
                        "--engine-args='--disable-decode-gemv --disable-native-gemm' for the decode step without native gemv and panel products)")
    p.add_argument("--colocated-threads", type=int, default=None,
                   help="torch threads of the colocated server; default: every core. On a machine shared "
                        "with other work, threads > free cores make every step wait for a descheduled thread")
    p.add_argument("--out-dir", default="results/compare_disagg")
    add_stand_args(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    a.rates = a.rates or ([0.25, 0.75] if a.quick else [0.5, 1.0, 2.0, 3.0])
    a.num_prompts = a.num_prompts or (10 if a.quick else 40)
    for name, full, quick in LENGTHS:
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    a.long_period = a.long_period or (4.0 if a.quick else 3.0)
    if any(not (r > 0 and math.isfinite(r)) for r in a.rates):
        p.error(f"--rates must be finite and > 0, got {a.rates}")
    if a.num_prompts < 2:
        p.error(f"--num-prompts must be >= 2, got {a.num_prompts}")
    for name, _, _ in LENGTHS:
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.local_prefill_max_tokens < 1:
        p.error("--local-prefill-max-tokens must be >= 1")
    if a.long_period <= 0 or a.interference_period <= 0 or a.slo_ttft_ms <= 0 or a.slo_tpot_ms <= 0:
        p.error("--long-period, --interference-period, --slo-ttft-ms and --slo-tpot-ms must be > 0")
    if a.colocated_threads is not None and a.colocated_threads < 1:
        p.error(f"--colocated-threads must be >= 1, got {a.colocated_threads}")
    if a.model_path and not os.path.exists(a.model_path):
        p.error(f"--model-path: no such file or directory: {a.model_path}")
    return a


# --- workloads -----------------------------------------------------------------------------------


def long_rows(tokenizer, n: int, lengths: tuple[int, int], ratio: float, seed: int) -> list:
    """``n`` random prompts of ``lengths`` = (input, output) tokens, the input's length uniform down to
    ``ratio`` of it; the output length is fixed (only the prompt's varies)."""
    rows = datasets.sample_random(tokenizer, n, lengths[0], lengths[1], ratio, seed)
    return rows if ratio == 1.0 else [dataclasses.replace(r, output_len=lengths[1]) for r in rows]


def workload(name: str, rate: float, args, tokenizer) -> tuple[list, list[float], list[str]]:
    """Rows, send offsets (s) and a kind per row ("steady", "stream" or "long"), ordered by offset."""
    seed = args.seed + int(rate * 1000)
    if name == "steady":
        rows = datasets.sample_random(tokenizer, args.num_prompts, args.steady_input_len, args.steady_output_len,
                                      0.5, seed)
        return rows, arrival_offsets(len(rows), rate, seed), ["steady"] * len(rows)
    if name == "mixed":
        short_len, period = (args.stream_input_len, args.stream_output_len), args.long_period
        long_len, long_ratio = (args.long_input_len, 2), 1.0
    else:
        short_len, period = (args.short_input_len, args.short_output_len), args.interference_period
        long_len = (args.interference_long_len, args.interference_long_output_len)
        long_ratio = INTERFERENCE_LONG_RATIO
    kind = SHORT_KINDS[name]
    streams = datasets.sample_random(tokenizer, args.num_prompts, *short_len, 1.0, seed)
    offsets = arrival_offsets(len(streams), rate, seed)
    # long prompts over the span of the short arrivals, the first one after the first shorts started
    n_long = max(1, int(offsets[-1] // period))
    longs = long_rows(tokenizer, n_long, long_len, long_ratio, seed + 7)
    long_offsets = [period * (k + 0.5) for k in range(n_long)]
    merged = sorted(zip(offsets + long_offsets, streams + longs, [kind] * len(streams) + ["long"] * n_long),
                    key=lambda t: t[0])
    return [r for _, r, _ in merged], [t for t, _, _ in merged], [k for _, _, k in merged]


def idle_ttft(base_url: str, args, tokenizer) -> dict:
    """TTFT of the interference workload's short and long prompts sent one at a time to an idle
    setup (median of ``IDLE_PROBES`` each): the baseline its comparison rate doubles, and what
    bounds TTFT at low load (one core per server against two for the colocated one)."""
    short = datasets.sample_random(tokenizer, IDLE_PROBES[0], args.short_input_len, args.short_output_len, 1.0,
                                   args.seed + 1)
    long = long_rows(tokenizer, IDLE_PROBES[1], (args.interference_long_len, args.interference_long_output_len),
                     INTERFERENCE_LONG_RATIO, args.seed + 2)
    rows = short + long
    outputs, _ = asyncio.run(benchmark(base_url, BACKENDS[args.backend](), rows, [0.0] * len(rows),
                                       max_concurrency=1, warmup_requests=1, request_timeout=600.0))
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"idle probe failed: {failed[0]}")
    ttft = [o.ttft * 1000 for o in outputs]
    out = {"short_ttft_ms": statistics.median(ttft[:len(short)]), "long_ttft_ms": statistics.median(ttft[len(short):])}
    print(f"  idle TTFT: short ({args.short_input_len} tokens) {out['short_ttft_ms']:.1f} ms, long "
          f"({int(INTERFERENCE_LONG_RATIO * args.interference_long_len)}-{args.interference_long_len} tokens) {out['long_ttft_ms']:.1f} ms",
          flush=True)
    return out


def measure(base_url: str, name: str, rate: float, args, tokenizer) -> dict:
    rows, offsets, kinds = workload(name, rate, args, tokenizer)
    outputs, duration = asyncio.run(benchmark(base_url, BACKENDS[args.backend](), rows, offsets,
                                              warmup_requests=2, request_timeout=600.0))
    m = calculate_metrics(outputs, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    m["rate"] = rate
    m["num_requests"] = len(rows)
    m["tpots"] = [o.tpot for o in outputs if o.success]
    if name in SHORT_KINDS:  # the short requests are what interference hurts: their metrics on their own
        kind = SHORT_KINDS[name]
        s = calculate_metrics([o for o, k in zip(outputs, kinds) if k == kind], duration,
                              args.slo_ttft_ms, args.slo_tpot_ms)
        prefix = "streams" if name == "mixed" else "short"
        m[f"{prefix}_p99_tpot_ms"] = s["p99_tpot_ms"]
        m[f"{prefix}_median_tpot_ms"] = s["median_tpot_ms"]
        m[f"{prefix}_median_ttft_ms"] = s["median_ttft_ms"]
        m["long_prompts"] = kinds.count("long")
        m["tpots"] = [o.tpot for o, k in zip(outputs, kinds) if o.success and k == kind]
    errors = sorted({o.error for o in outputs if not o.success})
    if errors:
        m["errors"] = errors[:5]
    print(f"  {name:<6} rate {rate:<5g} completed {m['completed']}/{len(rows)}  p50/p99 TTFT "
          f"{_f(m['median_ttft_ms'])}/{_f(m['p99_ttft_ms'])} ms  p50/p99 TPOT {_f(m['median_tpot_ms'])}/"
          f"{_f(m['p99_tpot_ms'])} ms  goodput {m['goodput']:.2f} req/s"
          + (f"  short p50 TTFT {_f(m['short_median_ttft_ms'])} ms, p99 TPOT {_f(m['short_p99_tpot_ms'])} ms"
             if name == "interference" else ""), flush=True)
    return m


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


# --- the setups ------------------------------------------------------------------------------


class Colocated:
    """One ``pdserve serve`` in null mode on every core, in its own process group."""

    def __init__(self, args, log_dir: str, extra_args: tuple[str, ...] = (), name: str = "colocated"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(log_dir, f"{name}.log")
        threads = args.colocated_threads or len(os.sched_getaffinity(0))
        argv = [sys.executable, "-m", "pdserve.engine", "--port", str(self.port), "--disaggregation-mode", "null",
                "--num-threads", str(threads), "--max-total-tokens", str(args.max_total_tokens)]
        if args.model_path:
            argv += ["--model-path", args.model_path]
        argv += shlex.split(args.engine_args) + list(extra_args)
        self.proc = spawn(argv, self.log, die_with_parent=True)
        try:
            wait_healthy(self.url, self.proc, args.startup_timeout, name="colocated server",
                         log=lambda: f"{self.log}:\n{log_tail(self.log)}")
        except (RuntimeError, TimeoutError):
            self.stop()
            raise

    def stop(self) -> None:
        stop_group(self.proc)


def start_1p1d(args, log_dir: str, local: bool = False) -> Cluster:
    """1 prefill + 1 decode behind the router; ``local``: with conditional disaggregation (every
    server gets --max-local-prefill-tokens, which only a decode server uses)."""
    engine_args = ("--max-total-tokens", str(args.max_total_tokens), *shlex.split(args.engine_args))
    router_args: tuple[str, ...] = ()
    if local:
        n = str(args.local_prefill_max_tokens)
        engine_args += ("--max-local-prefill-tokens", n)
        router_args = ("--prefill-policy", "kv_aware", "--local-prefill-max-tokens", n)
    cfg = LaunchConfig(prefill=1, decode=1, cpu_split="auto", port=0, model_path=args.model_path,
                       transfer_backend=args.transfer_backend, log_dir=log_dir, engine_args=engine_args,
                       router_args=router_args, startup_timeout=args.startup_timeout)
    cluster = Cluster(cfg)
    try:
        cluster.start()
        cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    return cluster


# --- reporting -----------------------------------------------------------------------------------


def comparison_rate(results: dict, name: str, slo_tpot_ms: float, idle: dict | None = None) -> float:
    """interference (with 1p1d measured): the lowest rate where 1p1d's short p50 TTFT is at least
    twice its idle value (``idle``: ``idle_ttft`` per setup; without it, that at the lowest rate):
    its short requests queue behind long prefills; otherwise the lowest rate where the colocated
    server's p99 TPOT misses the SLO; else the highest rate."""
    if name == "interference" and "1p1d" in results:
        runs = results["1p1d"][name]
        base = (idle or {}).get("1p1d", {}).get("short_ttft_ms")
        idle_ms = base if base is not None else runs[0].get("short_median_ttft_ms")
        for m in runs if base is not None else runs[1:]:
            if idle_ms and m.get("short_median_ttft_ms") is not None and m["short_median_ttft_ms"] >= 2 * idle_ms:
                return m["rate"]
        return runs[-1]["rate"]
    key = "streams_p99_tpot_ms" if name == "mixed" else "p99_tpot_ms"
    runs = (results.get("colocated") or next(iter(results.values())))[name]
    for m in runs:
        if m.get(key) is not None and m[key] > slo_tpot_ms:
            return m["rate"]
    return runs[-1]["rate"]


def ratio(a, b):
    return None if a is None or b is None or a == 0 else b / a


def _ratio_text(a, b, r) -> str:
    if r is None:
        return "inf" if a == 0 and b else "n/a"  # e.g. goodput: colocated met the SLO for no request
    return f"{r:.3f}" if r < 0.1 else f"{r:.2f}"


# (numerator, denominator, column title) of the ratio columns, where both setups were measured
RATIOS = (("1p1d", "colocated", "1p1d/col"), ("1p1d+local", "colocated", "local/col"),
          ("1p1d+local", "1p1d", "local/1p1d"))


def table_keys(name: str) -> list[tuple[str, str, bool]]:
    keys = list(TABLE_KEYS)
    if name == "mixed":
        keys.insert(4, ("streams p99 TPOT ms", "streams_p99_tpot_ms", False))
    if name == "interference":
        keys[4:4] = [("short p50 TTFT ms", "short_median_ttft_ms", False),
                     ("short p99 TPOT ms", "short_p99_tpot_ms", False)]
    return keys


def ratio_table(results: dict, name: str, rate: float) -> tuple[str, dict]:
    """The table of every measured setup at ``rate`` with the ratio columns of ``RATIOS``; returns
    it and the ratios by column title, then metric key (``1p1d/col`` also flat, by metric key)."""
    at = {s: next(m for m in results[s][name] if m["rate"] == rate) for s in SETUPS if s in results}
    cols = [c for c in RATIOS if c[0] in at and c[1] in at]
    pad = " " * (len(name) + len(f"{rate:g}") + 12)
    lines = [f"{name} at {rate:g} req/s: {'metric':<20} " + " ".join(f"{s:>10}" for s in at)
             + " " + " ".join(f"{t:>10}" for _, _, t in cols)]
    ratios: dict = {t: {} for _, _, t in cols}
    for label, key, _ in table_keys(name):
        cells = []
        for num, den, title in cols:
            a, b = at[den].get(key), at[num].get(key)
            ratios[title][key] = ratio(a, b)
            cells.append(f"{_ratio_text(a, b, ratios[title][key]):>10}")
        lines.append(f"{pad}{label:<20} " + " ".join(f"{_f(m.get(key)):>10}" for m in at.values())
                     + " " + " ".join(cells))
    if "1p1d/col" in ratios:
        ratios.update(ratios["1p1d/col"])  # the flat form older readers use
    return "\n".join(lines), ratios


def plot(results: dict, workloads: list[str], args, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(workloads), 2, figsize=(10, 3.6 * len(workloads)), squeeze=False)
    for row, name in enumerate(workloads):
        tpot_key = {"mixed": "streams_p99_tpot_ms", "interference": "short_p99_tpot_ms"}.get(name, "p99_tpot_ms")
        for setup, style in zip(SETUPS, ("o-", "s--", "^-.")):
            if setup not in results:
                continue
            ms = results[setup][name]
            axes[row][0].plot([m["rate"] for m in ms], [m["goodput"] for m in ms], style, label=setup)
            axes[row][1].plot([m["rate"] for m in ms], [m.get(tpot_key) or math.nan for m in ms], style, label=setup)
        axes[row][0].set_title(f"{name}: goodput (TTFT<={args.slo_ttft_ms:g} ms, TPOT<={args.slo_tpot_ms:g} ms)")
        axes[row][0].set_ylabel("req/s")
        axes[row][1].axhline(args.slo_tpot_ms, color="grey", lw=0.8, ls=":", label="TPOT SLO")
        axes[row][1].set_title(f"{name}: p99 TPOT" + {"mixed": " of the streams",
                                                       "interference": " of the short requests"}.get(name, ""))
        axes[row][1].set_ylabel("ms")
        for ax in axes[row]:
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out_dir, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix="pdserve-compare-")
    from pdserve.engine.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model_path)
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    print(f"compare_disagg: {cores} cores (load average {load:.1f}), rates {args.rates}, "
          f"workloads {args.workloads}, logs in {log_dir}", flush=True)
    results: dict = {s: {w: [] for w in args.workloads} for s in args.setups}
    idle: dict = {}  # setup -> idle_ttft (interference only)
    for setup in args.setups:
        t = time.monotonic()
        server = Colocated(args, log_dir) if setup == "colocated" else \
            start_1p1d(args, log_dir, local=setup == "1p1d+local")
        url = server.url
        print(f"{setup}: ready at {url} in {time.monotonic() - t:.0f} s", flush=True)
        try:
            if "interference" in args.workloads:
                idle[setup] = idle_ttft(url, args, tokenizer)
            for name in args.workloads:
                for rate in args.rates:
                    results[setup][name].append(measure(url, name, rate, args, tokenizer))
        finally:
            server.stop()

    summary = {"bench": "compare_disagg", "quick": args.quick, "cores": cores, "load_avg_start": round(load, 2),
               "load_avg_end": round(os.getloadavg()[0], 2), "rates": args.rates, "backend": args.backend,
               "colocated_threads": args.colocated_threads or cores, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "num_prompts": args.num_prompts,
               "setups": args.setups, "local_prefill_max_tokens": args.local_prefill_max_tokens,
               "engine_args": args.engine_args,
               "workloads": {}}
    from benchlib.plots import plot_cdf

    print()
    for name in args.workloads:
        rate = comparison_rate(results, name, args.slo_tpot_ms, idle)
        table, ratios = ratio_table(results, name, rate)
        print(table + "\n")
        cdf = plot_cdf({s: next(m for m in results[s][name] if m["rate"] == rate) for s in args.setups}, "tpots",
                       f"TPOT, {name} at {rate:g} req/s", os.path.join(args.out_dir, f"tpot_cdf_{name}.png"))
        keep = [k for _, k, _ in table_keys(name)] + [
            "rate", "completed", "failed", "num_requests", "slo_attainment", "streams_median_tpot_ms",
            "short_median_tpot_ms", "long_prompts", "errors"]
        summary["workloads"][name] = {
            "comparison_rate": rate,
            **({"idle_ttft_ms": idle} if name == "interference" else {}),
            "ratios": {t: {k: (None if v is None else round(v, 3)) for k, v in r.items()}
                       for t, r in ratios.items() if isinstance(r, dict)},
            **{s: [{k: m[k] for k in keep if k in m} for m in results[s][name]] for s in args.setups},
            "tpot_cdf_png": cdf,
        }
    summary["plot"] = plot(results, args.workloads, args, os.path.join(args.out_dir, "compare_disagg.png"))
    print(f"plot: {summary['plot']}")
    line = json.dumps(summary, allow_nan=False, default=lambda v: None)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)
    failed = sum(m["failed"] for s in args.setups for w in args.workloads for m in results[s][w])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
