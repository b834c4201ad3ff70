"""Throughput of a 1P1D pair with ``--enable-trace`` (every request traced) against one without.

Starts two pairs of real servers (prefill + decode over Mooncake TCP, bf16, the default model):
one plain, one with ``--enable-trace`` at ``--trace-sample-ratio`` 1.0 exporting to an OTLP/HTTP
receiver in a process of its own (``tests/support/otlp_receiver.py``; a collector never shares
the client's interpreter, whose threads it would slow on the traced side only). Each round sends the same batch of
requests (fresh random prompts, ``--concurrency`` in flight, direct pairing with
``bootstrap_host/port/room`` as a router does) through one pair, then through the other, the order
swapped every round (``benchlib/ab_rounds.py``). Throughput: output tokens per second of a round.
The ratio is the median of the rounds' traced/plain throughput ratios. Target: >= 0.97.
Also reported: the CPU seconds the pair's processes (HTTP process and rank, each server) spent
per round, as the median of the rounds' traced/plain ratios: on a machine shared with other load
it shows the cost of tracing where wall time is noisy. The spans received are counted, so a
traced side that exported nothing shows.

    .venv/bin/python scripts/bench_tracing.py [--requests 16] [--concurrency 4] [--input-len 256]
        [--output-len 32] [--rounds 4]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # benchlib by path: scripts/ is not a package
sys.path.insert(0, str(REPO / "tests"))  # the OTLP receiver the tests use

from benchlib.ab_rounds import round_ratios  # noqa: E402
from support.otlp_receiver import OtlpReceiver  # noqa: E402

from pdserve.entrypoints.procs import free_port, spawn, stop_group, wait_healthy  # noqa: E402

TARGET_RATIO = 0.97


class Server:
    def __init__(self, name: str, mode: str, threads: int, *extra: str):
        self.port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else None
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.engine", "--port", str(self.port), "--dtype", "bfloat16",
               "--max-total-tokens", "8192", "--num-threads", str(threads), "--log-level", "warning",
               "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake"]
        if self.bootstrap_port:
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        cmd += extra
        self.log_path = f"/tmp/bench-tracing-{name}-{os.getpid()}.log"
        self.proc = spawn(cmd, self.log_path, cwd=REPO)  # the span exporter's defaults, as a user gets them

    def wait_ready(self, timeout: float = 600) -> None:
        wait_healthy(self.url, self.proc, timeout, name="server", log=lambda: f"see {self.log_path}", period=0.5)

    def stop(self) -> None:
        stop_group(self.proc, grace=20.0)

    def cpu_seconds(self) -> float:
        """User + system CPU time so far of every live process in the server's process group."""
        pgid, total = os.getpgid(self.proc.pid), 0
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    fields = Path(f"/proc/{d}/stat").read_text().rpartition(")")[2].split()
                except OSError:
                    continue
                if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
                    total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")


def _receive(conn) -> None:
    """The receiver process: sends its endpoint, then, when told to close, the span names it got."""
    receiver = OtlpReceiver()
    conn.send(receiver.endpoint)
    conn.recv()
    names = [s.name for s in receiver.spans]
    receiver.close()
    conn.send(names)


class ReceiverProcess:
    """An OTLP/HTTP receiver in a spawned process (the servers export to it as to a collector)."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receive, args=(child,), daemon=True)
        self.proc.start()
        self.endpoint = self.conn.recv()

    def close(self) -> list[str]:
        """The names of every span received, once the receiver has stopped."""
        self.conn.send("close")
        names = self.conn.recv()
        self.proc.join(30)
        return names


def one_request(session: requests.Session, P: Server, D: Server, ids: list[int], output_len: int) -> int:
    """One request through the pair (both legs at once); the decode's output tokens."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": P.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    errors: list = []

    def prefill_leg():
        try:
            requests.post(P.url + "/generate", json=body, timeout=600).raise_for_status()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=prefill_leg)
    t.start()
    r = session.post(D.url + "/generate", json=body, timeout=600)
    t.join()
    r.raise_for_status()
    if errors:
        raise RuntimeError(f"prefill leg failed: {errors[0]}")
    return len(r.json()["output_ids"])


def run_round(pair: tuple[Server, Server], prompts: list[list[int]], args) -> tuple[int, float]:
    """Every prompt through ``pair`` at ``args.concurrency``: (output tokens, seconds)."""
    sessions = [requests.Session() for _ in range(args.concurrency)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.concurrency) as ex:
        futs = [ex.submit(one_request, sessions[i % args.concurrency], *pair, ids, args.output_len)
                for i, ids in enumerate(prompts)]
        tokens = sum(f.result() for f in futs)
    return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="requests per round and side")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="--num-threads of each server")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    receiver = ReceiverProcess()
    trace = ("--enable-trace", "--otlp-traces-endpoint", receiver.endpoint, "--trace-sample-ratio", "1.0")
    servers = {"plain": (Server("P-plain", "prefill", args.threads), Server("D-plain", "decode", args.threads)),
               "traced": (Server("P-traced", "prefill", args.threads, *trace),
                          Server("D-traced", "decode", args.threads, *trace))}
    times: dict[str, list[float]] = {name: [] for name in servers}
    cpu: dict[str, list[float]] = {name: [] for name in servers}
    tokens: dict[str, int] = dict.fromkeys(servers, 0)
    try:
        for pair in servers.values():
            for s in pair:
                s.wait_ready()
        warm = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.concurrency)]
        for pair in servers.values():
            run_round(pair, warm, args)
        for r in range(args.rounds):
            # fresh prompts each round (no prefix-cache hits), the same for both sides
            prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.requests)]
            for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                cpu0 = sum(s.cpu_seconds() for s in servers[name])
                n, secs = run_round(servers[name], prompts, args)
                cpu[name].append(sum(s.cpu_seconds() for s in servers[name]) - cpu0)
                tokens[name] += n
                times[name].append(secs)
                print(f"round {r} {name}: {n / secs:.1f} tok/s ({secs:.2f} s, {cpu[name][-1]:.2f} CPU s)", flush=True)
    finally:
        for pair in servers.values():
            for s in pair:
                s.stop()  # a server exports the spans it still holds as it stops
    names = receiver.close()
    ratio = round_ratios(times["traced"], times["plain"])
    cpu_ratio = round_ratios(cpu["plain"], cpu["traced"])["median"]  # traced CPU s / plain CPU s
    tput = {name: tokens[name] / sum(times[name]) for name in servers}
    print(f"plain {tput['plain']:.1f} tok/s, traced {tput['traced']:.1f} tok/s; per-round ratio median "
          f"{ratio['median']:.3f} (min {ratio['min']:.3f}, max {ratio['max']:.3f}); CPU s traced/plain "
          f"{cpu_ratio:.3f}; spans received "
          f"{len(names)} ({names.count('prefill.chunk')} prefill.chunk, {names.count('decode.step')} decode.step)")
    print(json.dumps({"bench": "tracing", "requests": args.requests, "concurrency": args.concurrency,
                      "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
                      "plain_tok_s": round(tput["plain"], 2), "traced_tok_s": round(tput["traced"], 2),
                      "ratio_median": round(ratio["median"], 4), "ratio_min": round(ratio["min"], 4),
                      "ratio_max": round(ratio["max"], 4), "cpu_ratio_median": round(cpu_ratio, 4),
                      "spans": len(names),
                      "target": TARGET_RATIO, "meets_target": ratio["median"] >= TARGET_RATIO}))


if __name__ == "__main__":
    main()
