"""The cluster's KV cache behind the router: 2 prefill + 1 decode, round-robin prefill routing,
multi-turn conversations, with the hierarchy off, L2, and L2 + Mooncake Store with decode write-back.

    .venv/bin/python scripts/bench_hicache_pd.py                   # a few minutes on 2 cores

One invocation runs three configurations, each on fresh servers (2 prefill, 1 decode, the
router with ``--prefill-policy round_robin``: no affinity, so only a shared store carries a
conversation from one prefill server to the other):

  off   none of the hierarchy: the radix cache alone on the prefill servers, and a decode that keeps
        no finished sequence (``--disable-radix-cache`` there: no decode prefix reuse, as before it)
  L2    ``--enable-hierarchical-cache`` on every server (a host tier that holds every conversation)
  L3    L2 plus ``--hicache-storage-backend mooncake`` on every server: a real ``mooncake_master``
        and a standalone ``mooncake_client`` holding the objects (entrypoints/mooncake_service.py);
        the decode writes each finished sequence (prompt and answer) back to the store

Each prefill server's KV pool holds about a quarter of the live conversations. The decode's
(``--decode-pool``): ``batch`` (the default), every conversation's final turn at once, as a decode
pool is sized for its batch, so TTFT is the prefill's; or ``quarter``, the prefill's size (at least
two final-length sequences, so it can decode), where the decode's queue for room then dominates
TTFT at later turns, which no prefill-side cache can shorten. The workload is ``bench_serving --dataset
multi-turn``'s (benchlib/multi_turn.py): N conversations of T turns of generated random ids, each
prompt the whole history plus a new message; a turn's requests go together. After L3's T turns
prefill server 0 is restarted (its pool and host tier empty, the store full) and two more turns
are played: its hit rate over them is the restart figure.

``--one-by-one`` plays each conversation's turns alone, one request at a time, then the next
conversation (every request finds the servers idle), and skips the restart; ``--prefetch-policy``
takes several values (``default``: the servers' own default, no flag), each an L3 run of its own:

    .venv/bin/python scripts/bench_hicache_pd.py --configs L3 --one-by-one --conversations 7 \
        --turns 4 --prefetch-policy best_effort default

Figures: the hit rate (the prefill servers' ``pdserve_cached_tokens_total`` over the ideal, every
earlier turn's tokens cached, page-aligned), hit tokens per tier (``pdserve_hicache_hit_tokens_total``),
prompt tokens computed, p50 TTFT at turns >= 3 (client), KV bytes prefill -> decode at turns >= 2
(``pdserve_kv_transfer_sent_bytes_total``). The issue's targets for L3, each PASS/FAIL:
hit rate >= 0.9 of the ideal; computed <= 0.3x off; p50 TTFT (turns >= 3) <= 0.5x off; KV bytes
(turns >= 2) <= 0.5x off; restarted server's hit rate over its next two turns >= 0.8 of the ideal.
The restarted server's ideal is its prompt tokens times the turn's ideal share (the client does
not see which prefill server a request went to). Ends with ONE JSON line (also ``--output-file``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package

from benchlib import multi_turn, server_metrics  # noqa: E402
from benchlib.stand_args import add_stand_args  # noqa: E402

from pdserve.entrypoints.mooncake_service import MooncakeService  # noqa: E402
from pdserve.entrypoints.procs import free_port, log_tail, spawn, stop_groups, wait_healthy  # noqa: E402

HOST = "127.0.0.1"
PAGE = 16  # the servers' --page-size (the default)
TARGETS = {  # the issue's, for L3 against off
    "hit_rate_of_ideal": (">=", 0.9),
    "computed_over_off": ("<=", 0.3),
    "p50_ttft_turn3plus_over_off": ("<=", 0.5),
    "kv_bytes_turn2plus_over_off": ("<=", 0.5),
    "restart_hit_rate_of_ideal": (">=", 0.8),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--message-len", type=int, default=24, help="tokens of each new message")
    p.add_argument("--answer-len", type=int, default=40, help="tokens of each answer")
    p.add_argument("--think-time", type=float, default=0.5, help="seconds between turns")
    p.add_argument("--decode-pool", default="batch", choices=("quarter", "batch"),
                   help="the decode's KV pool: quarter (like the prefill servers', at least two final-length "
                        "sequences) or batch (every conversation's final turn at once: the decode never queues)")
    p.add_argument("--prefetch-policy", nargs="+", default=["default"],
                   choices=("default", "best_effort", "wait_complete", "timeout"),
                   help="L3's --hicache-storage-prefetch-policy; several: one L3 run each")
    p.add_argument("--one-by-one", action="store_true",
                   help="each conversation's turns alone, then the next (idle servers); no restart phase")
    p.add_argument("--configs", nargs="+", default=["off", "L2", "L3"], choices=("off", "L2", "L3"))
    add_stand_args(p)
    return p


class Stand:
    """2 prefill + 1 decode servers and the router, started with one configuration's flags."""

    def __init__(self, name: str, args, pool_tokens: int, decode_tokens: int, hicache: list[str], log_dir: str):
        self.name, self.args, self.log_dir, self.hicache = name, args, log_dir, hicache
        self.pool_tokens, self.decode_tokens = pool_tokens, decode_tokens
        self.prefills = [(free_port(), free_port()) for _ in range(2)]  # (HTTP, bootstrap) ports
        self.decode_port = free_port()
        self.procs: dict[str, object] = {}
        self.router = None
        self.url = ""

    def _argv(self, role: str, port: int, extra: list[str]) -> list[str]:
        argv = [sys.executable, "-m", "pdserve.engine", "--host", HOST, "--port", str(port),
                "--disaggregation-mode", role, "--disaggregation-transfer-backend", self.args.transfer_backend,
                "--num-threads", "1", "--log-level", "warning",
                "--num-reserved-decode-tokens", str(self.args.answer_len)]
        if self.args.model_path:
            argv += ["--model-path", self.args.model_path]
        return argv + extra + self.hicache

    def _spawn(self, key: str) -> None:
        if key == "decode":
            # off: the decode keeps nothing (its prefix reuse and write-back belong to the hierarchy)
            keep = ["--disable-radix-cache"] if not self.hicache else []
            argv = self._argv("decode", self.decode_port, ["--max-total-tokens", str(self.decode_tokens)] + keep)
        else:
            port, boot = self.prefills[int(key[-1])]
            argv = self._argv("prefill", port, ["--disaggregation-bootstrap-port", str(boot),
                                                "--max-total-tokens", str(self.pool_tokens)])
        self.procs[key] = spawn(argv, self._log(key), die_with_parent=True)

    def _log(self, key: str) -> str:
        return os.path.join(self.log_dir, f"{self.name}-{key}.log")

    def _wait(self, key: str, url: str) -> None:
        wait_healthy(url, self.procs[key], self.args.startup_timeout, name=f"{self.name} {key}",
                     log=lambda: f"{self._log(key)}:\n{log_tail(self._log(key))}")

    @property
    def prefill_urls(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port, _ in self.prefills]

    @property
    def decode_url(self) -> str:
        return f"http://{HOST}:{self.decode_port}"

    def start(self) -> None:
        for key in ("prefill0", "prefill1", "decode"):
            self._spawn(key)
        for key, url in zip(("prefill0", "prefill1", "decode"), self.prefill_urls + [self.decode_url]):
            self._wait(key, url)
        port = free_port()
        self.url = f"http://{HOST}:{port}"
        argv = [sys.executable, "-m", "pdserve.router", "--host", HOST, "--port", str(port),
                "--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--log-level", "warning"]
        for url, (_, boot) in zip(self.prefill_urls, self.prefills):
            argv += ["--prefill", url, str(boot)]
        argv += ["--decode", self.decode_url]
        self.router = spawn(argv, self._log("router"), die_with_parent=True)
        wait_healthy(self.url, self.router, 60, name=f"{self.name} router",
                     log=lambda: f"{self._log('router')}:\n{log_tail(self._log('router'))}")
        # one unrelated request through each prefill server (the first request of a server is slow)
        for _ in range(2):
            post(self.url, "/generate", {"input_ids": [11] * 8, "sampling_params": {"max_new_tokens": 2}})

    def restart_prefill(self, i: int) -> None:
        """Stop prefill server ``i`` and start it again with the same flags and ports."""
        key = f"prefill{i}"
        stop_groups([self.procs[key]])
        self._spawn(key)
        self._wait(key, self.prefill_urls[i])
        deadline = time.monotonic() + 60  # the router takes it back once its health check passes
        while time.monotonic() < deadline:
            try:
                post(self.url, "/generate", {"input_ids": [12] * 8, "sampling_params": {"max_new_tokens": 2}})
                post(self.url, "/generate", {"input_ids": [13] * 8, "sampling_params": {"max_new_tokens": 2}})
                break
            except OSError:
                time.sleep(1.0)

    def stop(self) -> None:
        stop_groups([p for p in [self.router, *self.procs.values()] if p is not None])


def post(url: str, path: str, body: dict) -> None:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def run_config(name: str, stand: Stand, convs: multi_turn.Conversations, turns: int, args) -> dict:
    """Play ``turns`` turns through the stand's router, scraping every server after each turn;
    for L3, then restart prefill 0 and play two more turns."""
    urls = stand.prefill_urls + [stand.decode_url]
    snaps = [[server_metrics.scrape(u) for u in urls]]
    if args.one_by_one:
        records = asyncio.run(multi_turn.play_one_by_one(stand.url, convs, range(turns), think_time=args.think_time))
        snaps += [[server_metrics.scrape(u) for u in urls]] * 2  # no per-turn split: "turn 2+" is the run
    else:
        records = asyncio.run(multi_turn.play_turns(
            stand.url, convs, range(turns), think_time=args.think_time,
            between_turns=lambda t: snaps.append([server_metrics.scrape(u) for u in urls])))
    prefill = lambda a, b: server_metrics.total(  # noqa: E731 - the prefill servers' counters added
        [server_metrics.delta(x, y) for x, y in zip(a[:2], b[:2])])
    run = prefill(snaps[-1], snaps[0])
    from_turn2 = prefill(snaps[-1], snaps[1])
    summary = multi_turn.summarize(records, PAGE)
    ideal = summary["ideal_cached_tokens"]
    out = {
        "config": name, "failed": summary["failed"], "errors": summary["errors"],
        "hit_rate_of_ideal": round(run["cached_tokens"] / ideal, 3) if ideal else None,
        "response_hit_rate_of_ideal": summary["hit_rate"],
        "cached_tokens": run["cached_tokens"], "ideal_cached_tokens": ideal,
        "host_hit_tokens": run["host_hit_tokens"], "storage_hit_tokens": run["storage_hit_tokens"],
        "prompt_tokens": run["prompt_tokens"], "computed_tokens": run["prompt_tokens"] - run["cached_tokens"],
        "p50_ttft_turn3plus_ms": multi_turn.p50_ttft_ms(records, 3),
        "kv_bytes_turn2plus": from_turn2["kv_sent_bytes"], "kv_bytes": run["kv_sent_bytes"],
        "decode_storage_put_pages": server_metrics.delta(snaps[-1][2], snaps[0][2])["storage_put_pages"],
        "prefill_storage": {k: run[k] for k in ("storage_get_pages", "storage_get_seconds", "host_load_seconds",
                                                "prefetch_complete", "prefetch_timeout", "prefetch_best_effort")},
        "p50_ttft_ms_by_turn": {t: r["p50_ttft_ms"] for t, r in summary["by_turn"].items()},
    }
    if name.startswith("L3") and not args.one_by_one:
        out["restart"] = restart_phase(stand, convs, turns, args)
    return out


def restart_phase(stand: Stand, convs: multi_turn.Conversations, turns: int, args) -> dict:
    """Restart prefill 0 and play two more turns; its hit rate against its share of the ideal."""
    stand.restart_prefill(0)
    url = stand.prefill_urls[0]
    before = server_metrics.scrape(url)
    per_turn = []

    def after_turn(t):
        nonlocal before
        now = server_metrics.scrape(url)
        per_turn.append(server_metrics.delta(now, before))
        before = now

    records = asyncio.run(multi_turn.play_turns(stand.url, convs, range(turns, turns + 2),
                                                think_time=args.think_time, between_turns=after_turn))
    summary = multi_turn.summarize(records, PAGE)
    cached = ideal = prompt = 0.0
    for t, d in zip(range(turns, turns + 2), per_turn):
        row = summary["by_turn"][t + 1]
        share = row["ideal"] / row["prompt"] if row["prompt"] else 0.0
        cached += d["cached_tokens"]
        ideal += d["prompt_tokens"] * share
        prompt += d["prompt_tokens"]
    return {"failed": summary["failed"], "errors": summary["errors"], "restarted_prompt_tokens": prompt, "restarted_cached_tokens": cached,
            "restarted_ideal_tokens": round(ideal), "restart_hit_rate_of_ideal": round(cached / ideal, 3) if ideal else None,
            "restarted_storage_hit_tokens": sum(d["storage_hit_tokens"] for d in per_turn),
            "all_servers_response_hit_rate_of_ideal": summary["hit_rate"]}


def check(value, target) -> str:
    op, bound = target
    if value is None:
        return "n/a"
    return "PASS" if (value >= bound if op == ">=" else value <= bound) else "FAIL"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the finally blocks stop the servers
    log_dir = tempfile.mkdtemp(prefix="pdserve-hicache-pd-")
    from pdserve.engine.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model_path)
    extra_turns = 2 if "L3" in args.configs and not args.one_by_one else 0
    final_len = args.turns * (args.message_len + args.answer_len)
    live = args.conversations * final_len
    longest = (args.turns + extra_turns) * (args.message_len + args.answer_len)  # the restart's turns too
    pool_tokens = max(live // 4, longest + 2 * PAGE)
    decode_tokens = max(live // 4, 2 * (longest + args.answer_len) + 2 * PAGE)
    if args.decode_pool == "batch":
        decode_tokens = args.conversations * (longest + args.answer_len + 2 * PAGE)
    ratio = 4.0 * (live + extra_turns * args.conversations * (args.message_len + args.answer_len)) / pool_tokens
    load = os.getloadavg()
    print(f"bench_hicache_pd: {len(os.sched_getaffinity(0))} cores, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; {args.conversations} conversations x {args.turns} turns ({args.message_len}-token "
          f"messages, {args.answer_len}-token answers); prefill pools {pool_tokens} tokens, decode {decode_tokens}, "
          f"live conversations {live} tokens; logs in {log_dir}", flush=True)
    l2 = ["--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:.2f}"]
    runs = {}
    names = [c for c in args.configs if c != "L3"]
    if "L3" in args.configs:
        names += ["L3"] if len(args.prefetch_policy) == 1 else [f"L3-{p}" for p in args.prefetch_policy]
    for name in names:
        policy = args.prefetch_policy[0] if name == "L3" else name.removeprefix("L3-")
        convs = multi_turn.make_conversations(tokenizer, args.conversations, args.turns + extra_turns,
                                              args.message_len, args.answer_len, 1.0, args.seed)
        store = None
        hicache = [] if name == "off" else l2
        if name.startswith("L3"):
            store = MooncakeService(log_dir, segment_size="256MB").start()
            hicache = l2 + ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                            json.dumps(store.extra_config())]
            if policy != "default":
                hicache += ["--hicache-storage-prefetch-policy", policy]
        stand = Stand(name, args, pool_tokens, decode_tokens, hicache, log_dir)
        t0 = time.monotonic()
        try:
            stand.start()
            runs[name] = run_config(name, stand, convs, args.turns, args)
        finally:
            stand.stop()
            if store is not None:
                store.stop()
        runs[name]["wall_s"] = round(time.monotonic() - t0, 1)
        print(name, json.dumps(runs[name]), flush=True)

    ratios, verdicts = {}, {}
    off, l3 = runs.get("off"), runs.get("L3")
    for name, r in runs.items():
        if name.startswith("L3-"):
            ratios[f"hit_rate_of_ideal {name}"] = r["hit_rate_of_ideal"]
            verdicts[f"hit_rate_of_ideal {name}"] = check(r["hit_rate_of_ideal"], TARGETS["hit_rate_of_ideal"])
    if l3:
        ratios["hit_rate_of_ideal"] = l3["hit_rate_of_ideal"]
        if "restart" in l3:
            ratios["restart_hit_rate_of_ideal"] = l3["restart"]["restart_hit_rate_of_ideal"]
    if l3 and off:
        div = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
        ratios["computed_over_off"] = div(l3["computed_tokens"], off["computed_tokens"])
        ratios["p50_ttft_turn3plus_over_off"] = div(l3["p50_ttft_turn3plus_ms"], off["p50_ttft_turn3plus_ms"])
        ratios["kv_bytes_turn2plus_over_off"] = div(l3["kv_bytes_turn2plus"], off["kv_bytes_turn2plus"])
    for k, v in ratios.items():
        if k in TARGETS:
            verdicts[k] = check(v, TARGETS[k])

    print(f"\n{'config':<6} {'hit/ideal':>9} {'host hit':>9} {'store hit':>9} {'computed':>9} "
          f"{'p50 TTFT t>=3 ms':>17} {'KV bytes t>=2':>14} {'failed':>6}")
    for r in runs.values():
        print(f"{r['config']:<6} {r['hit_rate_of_ideal']!s:>9} {r['host_hit_tokens']:>9.0f} "
              f"{r['storage_hit_tokens']:>9.0f} {r['computed_tokens']:>9.0f} {r['p50_ttft_turn3plus_ms']!s:>17} "
              f"{r['kv_bytes_turn2plus']:>14.0f} {r['failed']:>6}")
    for k, v in ratios.items():
        op, bound = TARGETS[k.split(" ")[0]]
        print(f"target {k}: {v} {op} {bound}: {verdicts[k]}")
    end = os.getloadavg()
    summary = {"bench": "hicache_pd", "args": vars(args), "cores": len(os.sched_getaffinity(0)),
               "load_avg_start": [round(x, 2) for x in load], "load_avg_end": [round(x, 2) for x in end],
               "prefill_pool_tokens": pool_tokens, "decode_pool_tokens": decode_tokens, "live_tokens": live,
               "runs": runs, "ratios": ratios, "verdicts": verdicts}
    line = json.dumps(summary)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0 if all(r["failed"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
