"""TTFT of 1 prefill + 1 decode server against the colocated server, same run, same machine.

Starts three real servers (colocated, prefill, decode; bf16, the default model,
mooncake over TCP unless ``--backend nixl``), then for each prompt length
(default 256, 1k, 4k tokens) measures time to first token, alternating the
two setups request by request so drift in background load hits both alike:

- colocated: a streamed ``/generate`` to the colocated server;
- 1P1D: the same body to the prefill and the decode server at once with
  ``bootstrap_host/port/room`` added (direct pairing, as a router does),
  TTFT = first token streamed by the decode server.

Every request has a fresh random prompt (no prefix-cache hits). Also reported:
the KV bytes moved per request and the transfer time of those bytes through
the same KV managers (``scripts/bench_kvtransfer.py``'s measurement, run here),
and its share of the 1P1D TTFT. Target: TTFT(1P1D) / TTFT(colocated) <= 1.10
at 1k tokens with mooncake. Ends with one JSON line.

    python scripts/bench_pd_overhead.py [--tokens 256 1024 4096] [--iters 5] [--backend mooncake]

``--layerwise``: the single-chunk long-prompt case of the layer-wise send instead. Per backend
(``--backends``), one decode server and two prefill servers, one with ``--disaggregation-layerwise``
and one without, both with ``--chunked-prefill-size`` at the longest prompt (each prompt is one
forward), the two alternated request by request. Reported per prompt length, as medians and as
layer-wise / chunk-level ratios: TTFT, and the exposed transfer time, from the end of the prefill
compute (its last forward and sampling) to the decode side's Success, read from the two servers'
debug log lines (``kv prefill: room R compute done at T``, ``kv decode: room R success at T``, wall
clock: one machine here). Target: exposed ratio <= 0.3 at the long prompts, TTFT ratio <= 1.

    python scripts/bench_pd_overhead.py --layerwise [--tokens 1024 4096 8000] [--iters 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

from pdserve.entrypoints.procs import free_port, spawn, stop_group, wait_healthy

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO_1K = 1.10
TARGET_EXPOSED_RATIO = 0.3  # layer-wise / chunk-level exposed transfer time, long single-chunk prompts
# SmolLM2-135M KV per token in bf16: 30 layers x K/V x 3 kv heads x 64 dims x 2 bytes
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2


class Server:
    def __init__(self, name: str, mode: str, backend: str, threads: int, max_total_tokens: int, *extra: str):
        """``extra``: more ``serve`` flags, last (they override the ones here)."""
        self.port = free_port()
        self.bootstrap_port = free_port() if mode == "prefill" else None
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.engine", "--port", str(self.port), "--dtype", "bfloat16",
               "--max-total-tokens", str(max_total_tokens), "--num-threads", str(threads),
               "--log-level", "warning", "--disaggregation-mode", mode]
        if mode != "null":
            cmd += ["--disaggregation-transfer-backend", backend]
        if self.bootstrap_port:
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        cmd += extra
        self.log_path = f"/tmp/bench-pd-{name}-{os.getpid()}.log"
        self.proc = spawn(cmd, self.log_path, cwd=REPO)

    def wait_ready(self, timeout: float = 600) -> None:
        wait_healthy(self.url, self.proc, timeout, name="server", log=lambda: f"see {self.log_path}", period=0.5)

    def stop(self) -> None:
        stop_group(self.proc, grace=20.0)


def stream_ttft(session: requests.Session, url: str, body: dict, t0: float) -> float:
    """Seconds from ``t0`` to the first SSE event carrying a token; reads the stream to its end."""
    ttft = None
    with session.post(url + "/generate", json=dict(body, stream=True), stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if ttft is None and line.startswith(b"data: {"):
                if json.loads(line[6:]).get("output_ids"):
                    ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft


def colocated_ttft(session, C: Server, body: dict) -> float:
    return stream_ttft(session, C.url, body, time.perf_counter())


def pd_ttft(sessions, P: Server, D: Server, body: dict, room: int | None = None) -> float:
    body = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=P.bootstrap_port,
                bootstrap_room=random.getrandbits(63) if room is None else room)
    errors: list = []

    def prefill_leg():
        try:
            r = sessions[0].post(P.url + "/generate", json=body, timeout=300)
            r.raise_for_status()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.perf_counter()
    t = threading.Thread(target=prefill_leg)
    t.start()
    ttft = stream_ttft(sessions[1], D.url, body, t0)
    t.join()
    if errors:
        raise RuntimeError(f"prefill leg failed: {errors[0]}")
    return ttft


def transfer_times(backend: str, tokens: list[int], iters: int) -> dict[int, float]:
    """Median seconds to move each prompt's KV through the KV managers (bench_kvtransfer's method)."""
    sys.path.insert(0, str(REPO / "scripts"))  # spawned children import it by this name too
    import bench_kvtransfer

    rows = bench_kvtransfer.bench_backend(backend, tokens, iters)
    return {r["tokens"]: r["manager_s"] for r in rows}


def _log_times(path: str, what: str) -> dict[int, float]:
    """room -> the wall-clock time of a KV manager's debug line ``room R <what> at T``."""
    pattern = re.compile(rf"room (\d+) {what} at ([0-9.]+)")
    with open(path, errors="replace") as f:
        return {int(m.group(1)): float(m.group(2)) for m in pattern.finditer(f.read())}


def layerwise_backend(backend: str, tokens: list[int], iters: int, threads: int, rng: random.Random) -> list[dict]:
    """One backend's rows of the layer-wise case: layer-wise against chunk-level prefill, same decode."""
    pool_tokens = max(16384, 3 * max(tokens))
    chunk = ["--chunked-prefill-size", str(max(tokens)), "--max-prefill-tokens", str(max(tokens)),
             "--log-level", "debug"]  # the KV managers' timing lines
    P_on = Server(f"prefill-layerwise-{backend}", "prefill", backend, threads, pool_tokens, *chunk,
                  "--disaggregation-layerwise")
    P_off = Server(f"prefill-chunk-{backend}", "prefill", backend, threads, pool_tokens, *chunk,
                   "--no-disaggregation-layerwise")
    D = Server(f"decode-{backend}", "decode", backend, 1, pool_tokens, "--log-level", "debug")
    servers, rows = [P_on, P_off, D], []
    try:
        for s in servers:
            s.wait_ready()
        sessions = {P: (requests.Session(), requests.Session()) for P in (P_on, P_off)}
        for n in tokens:
            ttft: dict = {P_on: [], P_off: []}
            rooms: dict = {P_on: [], P_off: []}
            for it in range(iters + 1):  # round 0 warms up both paths
                body = {"input_ids": [rng.randrange(100, 40000) for _ in range(n)],
                        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
                for P in ((P_on, P_off) if it % 2 == 0 else (P_off, P_on)):
                    room = random.getrandbits(63)
                    t = pd_ttft(sessions[P], P, D, body, room)
                    if it:
                        ttft[P].append(t)
                        rooms[P].append(room)
            time.sleep(1.0)  # the last debug lines reach the log files
            success = _log_times(D.log_path, "success")
            row = {"backend": backend, "tokens": n, "kv_bytes": n * KV_BYTES_PER_TOKEN}
            for P, key in ((P_on, "layerwise"), (P_off, "chunk")):
                computed = _log_times(P.log_path, "compute done")
                exposed = [success[r] - computed[r] for r in rooms[P] if r in success and r in computed]
                row[f"ttft_{key}_s"] = round(statistics.median(ttft[P]), 4)
                row[f"exposed_{key}_s"] = round(statistics.median(exposed), 4) if exposed else None
            row["ttft_ratio"] = round(row["ttft_layerwise_s"] / row["ttft_chunk_s"], 3)
            if row["exposed_layerwise_s"] is not None and row["exposed_chunk_s"]:
                row["exposed_ratio"] = round(row["exposed_layerwise_s"] / row["exposed_chunk_s"], 3)
            print(f"{backend:8s} {n:6d} tok  TTFT layer-wise {row['ttft_layerwise_s'] * 1e3:8.1f} ms  chunk "
                  f"{row['ttft_chunk_s'] * 1e3:8.1f} ms ({row['ttft_ratio']:.3f})  exposed layer-wise "
                  f"{(row['exposed_layerwise_s'] or 0) * 1e3:7.1f} ms  chunk {(row['exposed_chunk_s'] or 0) * 1e3:7.1f} ms "
                  f"({row.get('exposed_ratio')})", file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        for s in servers:
            s.stop()
    return rows


def layerwise_main(args) -> None:
    rng = random.Random(args.seed)
    random.seed(args.seed)
    rows = [r for b in args.backends for r in layerwise_backend(b, args.tokens, args.iters, args.threads, rng)]
    long = [r for r in rows if r["tokens"] >= 4096]
    print(json.dumps({
        "bench": "pd_overhead_layerwise",
        "model": "SmolLM2-135M-Instruct bf16",
        "threads_per_prefill": args.threads,
        "iters": args.iters,
        "load_avg": os.getloadavg(),
        "results": rows,
        "target_exposed_ratio": TARGET_EXPOSED_RATIO,
        "meets_target": bool(long) and all((r.get("exposed_ratio") or 1e9) <= TARGET_EXPOSED_RATIO
                                           and r["ttft_ratio"] <= 1.0 for r in long),
    }), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", nargs="+", type=int, default=None,
                    help="prompt lengths (default 256 1024 4096; with --layerwise 1024 4096 8000)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layerwise", action="store_true", help="the layer-wise send's case (module docstring)")
    ap.add_argument("--backends", nargs="+", default=["mooncake", "nixl"], choices=["mooncake", "nixl"],
                    help="--layerwise: the backends, one after the other")
    args = ap.parse_args()
    if args.layerwise:
        # SmolLM2-135M's context is 8192 tokens (GGUF llama.context_length): 8000 is its longest case
        args.tokens = args.tokens or [1024, 4096, 8000]
        layerwise_main(args)
        return
    args.tokens = args.tokens or [256, 1024, 4096]
    rng = random.Random(args.seed)
    random.seed(args.seed)
    pool_tokens = max(16384, 4 * max(args.tokens))
    servers = [
        Server("colocated", "null", args.backend, args.threads, pool_tokens),
        Server("prefill", "prefill", args.backend, args.threads, pool_tokens),
        Server("decode", "decode", args.backend, 1, pool_tokens),
    ]
    C, P, D = servers
    rows = []
    try:
        for s in servers:
            s.wait_ready()
        sc, sp, sd = requests.Session(), requests.Session(), requests.Session()
        for n in args.tokens:
            ttft_c, ttft_pd = [], []
            for it in range(args.iters + 1):  # round 0 warms up both paths
                body = {"input_ids": [rng.randrange(100, 40000) for _ in range(n)],
                        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
                if it % 2 == 0:
                    c = colocated_ttft(sc, C, body)
                    p = pd_ttft((sp, sd), P, D, body)
                else:
                    p = pd_ttft((sp, sd), P, D, body)
                    c = colocated_ttft(sc, C, body)
                if it:
                    ttft_c.append(c)
                    ttft_pd.append(p)
            mc, mp = statistics.median(ttft_c), statistics.median(ttft_pd)
            rows.append({"tokens": n, "ttft_colocated_s": round(mc, 4), "ttft_1p1d_s": round(mp, 4),
                         "ratio": round(mp / mc, 3), "kv_bytes": n * KV_BYTES_PER_TOKEN})
            print(f"{n:6d} tok  colocated {mc * 1e3:8.1f} ms  1P1D {mp * 1e3:8.1f} ms  ratio {mp / mc:.3f}",
                  file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    # the transfer alone, same bytes, same managers, after the servers are gone (no contention)
    xfer = transfer_times(args.backend, args.tokens, 3)
    for row in rows:
        t = xfer.get(row["tokens"])
        row["transfer_s"] = t
        row["transfer_share_of_ttft"] = round(t / row["ttft_1p1d_s"], 3) if t else None
    at_1k = next((r["ratio"] for r in rows if r["tokens"] == 1024), None)
    print(f"{'tokens':>6} {'colocated ms':>12} {'1P1D ms':>9} {'ratio':>6} {'KV MB':>7} {'xfer ms':>8} {'share':>6}",
          file=sys.stderr)
    for r in rows:
        print(f"{r['tokens']:6d} {r['ttft_colocated_s'] * 1e3:12.1f} {r['ttft_1p1d_s'] * 1e3:9.1f} {r['ratio']:6.3f} "
              f"{r['kv_bytes'] / 1e6:7.2f} {(r['transfer_s'] or 0) * 1e3:8.2f} {r['transfer_share_of_ttft'] or 0:6.3f}",
              file=sys.stderr)
    print(json.dumps({
        "bench": "pd_overhead",
        "backend": args.backend,
        "model": "SmolLM2-135M-Instruct bf16",
        "threads_per_server": args.threads,
        "iters": args.iters,
        "results": rows,
        "ratio_at_1k": at_1k,
        "target_ratio_at_1k": TARGET_RATIO_1K,
        "meets_target": at_1k is not None and at_1k <= TARGET_RATIO_1K,
    }), flush=True)


if __name__ == "__main__":
    main()
