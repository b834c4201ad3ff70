"""Prefill routing policies on a shared-prefix workload: kv_aware against cache_aware and round_robin.

    .venv/bin/python scripts/bench_kv_routing.py                      # a few minutes
    .venv/bin/python scripts/bench_kv_routing.py --policies kv_aware round_robin --sp-num-groups 16

Starts 2 prefill servers (each publishing its KV events, ``--kv-events-config``) and 1 decode
server once, then, for each policy in turn, a router (``--prefill-policy POLICY``) in front of
them, and runs ``bench_serving.py --dataset shared-prefix`` through it (the same rows at the
same arrival times for every policy). Between policies every server's prefix cache is flushed.

The prefill servers' KV pools (``--prefill-max-total-tokens``) are sized to hold about half of
the groups' system prompts each: a policy that keeps each group on one worker fits them all, one
that spreads groups over both makes each worker hold every prefix, and they evict each other.

Reported per policy: the prefix cache hit rate (the prefill servers' ``pdserve_cached_tokens_total``
over ``pdserve_prompt_tokens_total``, both counted during the run), the ideal hit rate (every
group on one worker: each group's first prompt misses its system prompt, the others hit all of
its full pages), p50/p99 TTFT and p50 TPOT at the client, with TTFT and hit-rate ratios against
round_robin; ONE JSON line at the end (also appended to ``--output-file``). Fixed seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

import bench_serving  # noqa: E402
from benchlib.stand_args import add_stand_args  # noqa: E402

from pdserve.entrypoints.procs import free_port, log_tail, spawn, stop_groups, wait_healthy  # noqa: E402
from pdserve.router.policy import POLICY_NAMES  # noqa: E402

HOST = "127.0.0.1"
PAGE_SIZE = 16  # the servers' --page-size (the default), for the ideal hit rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policies", nargs="+", choices=POLICY_NAMES, default=["kv_aware", "cache_aware", "round_robin"])
    p.add_argument("--sp-num-groups", type=int, default=8)
    p.add_argument("--sp-prompts-per-group", type=int, default=6)
    p.add_argument("--sp-system-prompt-len", type=int, default=512)
    p.add_argument("--sp-question-len", type=int, default=32)
    p.add_argument("--sp-output-len", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=1.5)
    p.add_argument("--prefill-max-total-tokens", type=int, default=3072,
                   help="KV pool of each prefill server (default: about half the groups' prefixes)")
    p.add_argument("--decode-max-total-tokens", type=int, default=16384)
    add_stand_args(p)
    return p


def events_flag() -> str:
    return json.dumps({"publisher": "zmq", "endpoint": f"tcp://{HOST}:{free_port()}",
                       "replay_endpoint": f"tcp://{HOST}:{free_port()}", "topic": "kv"})


def server_argv(role: str, port: int, args, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "pdserve.engine", "--host", HOST, "--port", str(port), "--disaggregation-mode",
            role, "--disaggregation-transfer-backend", args.transfer_backend, "--num-threads", "1",
            "--log-level", "warning"]
    if args.model_path:
        argv += ["--model-path", args.model_path]
    return argv + extra


def counters(url: str) -> tuple[float, float]:
    """(cached, prompt) tokens the server counted so far."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    return total("pdserve_cached_tokens_total"), total("pdserve_prompt_tokens_total")


def post(url: str, path: str, body: dict | None = None) -> None:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def ideal_hit_rate(args) -> float:
    cached = (args.sp_prompts_per_group - 1) * (args.sp_system_prompt_len // PAGE_SIZE * PAGE_SIZE)
    return cached / (args.sp_prompts_per_group * (args.sp_system_prompt_len + args.sp_question_len))


def run_policy(policy: str, prefills: list[tuple[str, int]], decode: str, rows, args, log_dir: str) -> dict:
    for url in [u for u, _ in prefills] + [decode]:
        post(url, "/flush_cache")
    port = free_port()
    url = f"http://{HOST}:{port}"
    argv = [sys.executable, "-m", "pdserve.router", "--host", HOST, "--port", str(port),
            "--prefill-policy", policy, "--decode-policy", "round_robin", "--log-level", "warning"]
    for u, b in prefills:
        argv += ["--prefill", u, str(b)]
    argv += ["--decode", decode]
    log = os.path.join(log_dir, f"router-{policy}.log")
    router = spawn(argv, log, die_with_parent=True)
    try:
        wait_healthy(url, router, 60, name=f"router ({policy})", log=lambda: f"{log}:\n{log_tail(log)}")
        # the first requests let kv_aware learn the workers (their events, the tokenizer); an
        # unrelated prompt, and the caches flushed again after it
        for _ in range(3):
            post(url, "/generate", {"input_ids": [11] * 8, "sampling_params": {"max_new_tokens": 1}})
            time.sleep(1.0)
        for u, _ in prefills:
            post(u, "/flush_cache")
        time.sleep(0.5)  # the flush's AllBlocksCleared reaches the router
        before = [counters(u) for u, _ in prefills]
        bench_args = bench_serving.parse_args([
            "--base-url", url, "--dataset", "shared-prefix", "--request-rate", str(args.request_rate),
            "--warmup-requests", "0", "--seed", str(args.seed), "--disable-tqdm",
            "--tag", f"bench_kv_routing {policy}"])
        result = bench_serving.run_benchmark(bench_args, rows=rows)
        after = [counters(u) for u, _ in prefills]
    finally:
        stop_groups([router])
    cached = [a[0] - b[0] for a, b in zip(after, before)]
    prompt = [a[1] - b[1] for a, b in zip(after, before)]
    return {"policy": policy, "hit_rate": sum(cached) / max(sum(prompt), 1.0),
            "cached_tokens": cached, "prompt_tokens": prompt,
            **{k: result[k] for k in ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")}}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the finally blocks stop the servers
    log_dir = tempfile.mkdtemp(prefix="pdserve-kv-routing-")
    from pdserve.engine.text.tokenizer import load_tokenizer
    from benchlib import datasets

    rows = datasets.sample_shared_prefix(load_tokenizer(args.model_path), args.sp_num_groups,
                                         args.sp_prompts_per_group, args.sp_system_prompt_len,
                                         args.sp_question_len, args.sp_output_len, args.seed)
    load = os.getloadavg()[0]
    print(f"bench_kv_routing: {len(os.sched_getaffinity(0))} cores (load average {load:.1f}), "
          f"{len(rows)} requests, logs in {log_dir}", flush=True)
    procs, prefills = [], []
    try:
        for i in range(2):
            port, boot = free_port(), free_port()
            extra = ["--disaggregation-bootstrap-port", str(boot), "--kv-events-config", events_flag(),
                     "--max-total-tokens", str(args.prefill_max_total_tokens)]
            procs.append(spawn(server_argv("prefill", port, args, extra), os.path.join(log_dir, f"prefill-{i}.log"),
                               die_with_parent=True))
            prefills.append((f"http://{HOST}:{port}", boot))
        port = free_port()
        decode = f"http://{HOST}:{port}"
        procs.append(spawn(server_argv("decode", port, args, ["--max-total-tokens", str(args.decode_max_total_tokens)]),
                           os.path.join(log_dir, "decode.log"), die_with_parent=True))
        for (u, _), p, name in zip(prefills + [(decode, None)], procs, ["prefill-0", "prefill-1", "decode"]):
            log = os.path.join(log_dir, f"{name}.log")
            wait_healthy(u, p, args.startup_timeout, name=name, log=lambda log=log: f"{log}:\n{log_tail(log)}")
        runs = [run_policy(policy, prefills, decode, rows, args, log_dir) for policy in args.policies]
    finally:
        stop_groups(procs)

    ideal = ideal_hit_rate(args)
    base = next((r for r in runs if r["policy"] == "round_robin"), None)
    print(f"\n{'policy':<12} {'hit rate':>9} {'ideal':>7} {'p50 TTFT ms':>12} {'p99 TTFT ms':>12} "
          f"{'p50 TPOT ms':>12} {'TTFT/rr':>8} {'per worker cached/prompt tokens'}")
    for r in runs:
        if base and base["median_ttft_ms"]:
            r["median_ttft_over_round_robin"] = r["median_ttft_ms"] / base["median_ttft_ms"]
        r["hit_rate_over_ideal"] = r["hit_rate"] / ideal
        ttft_ratio = r.get("median_ttft_over_round_robin")
        print(f"{r['policy']:<12} {r['hit_rate']:>9.3f} {ideal:>7.3f} {r['median_ttft_ms']:>12.1f} "
              f"{r['p99_ttft_ms']:>12.1f} {r['median_tpot_ms'] or 0:>12.1f} "
              f"{'n/a' if ttft_ratio is None else f'{ttft_ratio:.2f}':>8} "
              f"{[f'{c:.0f}/{p:.0f}' for c, p in zip(r['cached_tokens'], r['prompt_tokens'])]}")
    summary = {"bench": "kv_routing", "cores": len(os.sched_getaffinity(0)), "load_avg_start": round(load, 2),
               "load_avg_end": round(os.getloadavg()[0], 2), "requests": len(rows),
               "request_rate": args.request_rate, "prefill_max_total_tokens": args.prefill_max_total_tokens,
               "ideal_hit_rate": round(ideal, 4), "runs": runs}
    line = json.dumps(summary, default=lambda v: None)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
