"""TTFT and TPOT of a PD cluster whose servers span namespaces ("nodes"), against the same servers
with one namespace each, in one run; and the default model at TP 3 over three nodes.

Default (``--tp 2``): the tiny test checkpoint (4 heads, 2 KV heads), a prefill and a
decode server of ``--tp-size 2`` each. Baseline: each server in one namespace
(``--nnodes 1``: its two ranks talk over loopback), prefill, decode and router in
three namespaces. Measured: the same servers with ``--nnodes 2``, one rank per
namespace (prefill node 0/1, decode node 0/1, router: five namespaces on one bridge),
so every TP collective crosses a veth pair and the bridge, as it would cross a
network between hosts. The difference of the two TPOTs is what the cross-node
collectives cost per decode step (the tiny model's compute is negligible, so the
step is mostly its collectives); the last line prints it.

``--tp 3``: the default model (9 heads, 3 KV heads) as a prefill server of
``--tp-size 3 --nnodes 3`` (one rank per namespace) behind the router with a TP 1
decode server, against a colocated TP 1 server in the root namespace: greedy output
must be equal token for token (exit status 1 otherwise).

    sudo .venv/bin/python scripts/bench_multinode.py [--tp 2|3] [--backend mooncake|nixl]
        [--requests 16] [--prompt-len 64] [--max-new 32]

Needs root (``ip netns``). The namespaces and every process are removed at the end. The load
is sequential streamed greedy ``/generate`` requests sent from the router's namespace, so
TTFT and TPOT are latencies, not throughput under contention. Seeded prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the namespace helpers and server wrappers the CI's namespace test uses (one code path for both)
sys.path.insert(0, str(REPO / "tests"))  # the test tree's root: its shared helpers are ``support.*``

from support.netns_stand import NET, namespaces, ns_request, wait_up  # noqa: E402
from support.pd_stand import Proc, Server  # noqa: E402

from pdserve.entrypoints.procs import free_port  # noqa: E402

LOAD = r"""
import json, sys, time, requests
url, bodies = sys.argv[1], json.loads(sys.argv[2])
out = []
for b in bodies:
    t0 = time.perf_counter(); times = []; ids = []
    with requests.post(url, json=b, stream=True, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise SystemExit(f"error event: {ev}")
                if len(ev["output_ids"]) > len(ids):
                    times.append(time.perf_counter() - t0)
                ids = ev["output_ids"]
    out.append({"ttft": times[0], "tpot": (times[-1] - times[0]) / max(1, len(ids) - 1), "ids": ids})
print(json.dumps(out))
"""


def prompts(n: int, length: int, vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def greedy(ids: list[int], max_new: int, stream: bool) -> dict:
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


def server_nodes(name: str, mode: str, ns: dict, addrs: dict, keys: list[str], backend: str,
                 model_args: list[str], tp: int) -> list[Server]:
    """One server of ``--tp-size tp`` over ``len(keys)`` namespaces (node r in ``keys[r]``)."""
    nnodes = len(keys)
    dist = f"{addrs[keys[0]]}:{free_port()}"
    bootstrap = str(free_port())
    nodes = []
    for rank, key in enumerate(keys):
        env = {"GLOO_SOCKET_IFNAME": f"eth{key}", "UCX_TLS": "tcp", "UCX_NET_DEVICES": f"eth{key}"}
        extra = [*model_args, "--tp-size", str(tp), "--dist-timeout", "120"]
        if tp > 1:
            extra += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--dist-init-addr", dist]
        if mode == "prefill":
            extra += ["--disaggregation-bootstrap-port", bootstrap]
        nodes.append(Server(f"bm-{name}{rank}", mode, *extra, host=addrs[key], backend=backend, env=env,
                            cmd_prefix=["ip", "netns", "exec", ns[key]]))
    if mode == "prefill":
        nodes[0].bootstrap_port = int(bootstrap)
    return nodes


def run_cluster(label: str, addrs: dict, p_keys: list[str], d_keys: list[str], p_tp: int, d_tp: int,
                backend: str, model_args: list[str], bodies: list[dict]) -> list[dict]:
    """Start the servers and the router in their namespaces, send ``bodies`` one by one from the
    router's namespace, return each request's TTFT, TPOT and output ids; tear everything down."""
    procs: list[Proc] = []
    with namespaces(addrs) as ns:
        try:
            t0 = time.monotonic()
            p = server_nodes("p", "prefill", ns, addrs, p_keys, backend, model_args, p_tp)
            d = server_nodes("d", "decode", ns, addrs, d_keys, backend, model_args, d_tp)
            procs += p + d
            wait_up(ns[p_keys[0]], p[0].url + "/health", p, timeout=900)
            wait_up(ns[d_keys[0]], d[0].url + "/health", d, timeout=900)
            url = f"http://{addrs['r']}:30000"
            router = Proc("bm-router", [sys.executable, "-m", "pdserve.router", "--prefill", p[0].url,
                                        str(p[0].bootstrap_port), "--decode", d[0].url, "--host", addrs["r"],
                                        "--port", "30000", "--log-level", "warning"],
                          cmd_prefix=["ip", "netns", "exec", ns["r"]])
            procs.append(router)
            wait_up(ns["r"], url + "/health", [router], timeout=120)
            print(f"[{label}] up in {time.monotonic() - t0:.0f} s; load average {os.getloadavg()}", flush=True)
            warm = [dict(bodies[0], sampling_params={**bodies[0]["sampling_params"], "max_new_tokens": 4})]
            for batch in (warm, bodies):
                out = subprocess.run(["ip", "netns", "exec", ns["r"], sys.executable, "-c", LOAD,
                                      url + "/generate", json.dumps(batch)], capture_output=True, text=True,
                                     timeout=1800)
                if out.returncode != 0:
                    raise SystemExit(f"[{label}] load failed: {out.stderr[-2000:]}\n"
                                     + "\n".join(x.log(1500) for x in procs))
            return json.loads(out.stdout)
        finally:
            for x in procs[::-1]:
                x.stop()


def summary(label: str, results: list[dict]) -> tuple[float, float]:
    ttft = statistics.median(r["ttft"] for r in results) * 1e3
    tpot = statistics.median(r["tpot"] for r in results) * 1e3
    p90 = sorted(r["tpot"] for r in results)[int(0.9 * (len(results) - 1))] * 1e3
    print(f"| {label} | {len(results)} | {ttft:.1f} | {tpot:.2f} | {p90:.2f} |")
    return ttft, tpot


def bench_tp2(args) -> int:
    from support.model_util import make_tiny_checkpoint

    tiny = tempfile.mkdtemp(prefix="bm-tiny-")
    make_tiny_checkpoint("llama", tiny)
    model = ["--model-path", tiny, "--max-total-tokens", "4096"]
    bodies = [greedy(ids, args.max_new, True) for ids in prompts(args.requests, args.prompt_len, 500)]
    one = {"p0": f"{NET}.41", "d0": f"{NET}.43", "r": f"{NET}.45"}
    two = {"p0": f"{NET}.31", "p1": f"{NET}.32", "d0": f"{NET}.33", "d1": f"{NET}.34", "r": f"{NET}.35"}
    base = run_cluster("one namespace per server", one, ["p0"], ["d0"], 2, 2, args.backend, model, bodies)
    multi = run_cluster("two nodes per server", two, ["p0", "p1"], ["d0", "d1"], 2, 2, args.backend, model, bodies)
    same = all(a["ids"] == b["ids"] for a, b in zip(base, multi))
    print(f"\n{args.requests} sequential streamed greedy /generate requests, {args.prompt_len}-token prompts, "
          f"{args.max_new} new tokens, TP 2 prefill and decode, {args.backend}; outputs equal: {same}")
    print("| cluster | requests | TTFT median (ms) | TPOT median (ms) | TPOT p90 (ms) |\n| --- | --- | --- | --- | --- |")
    t1, s1 = summary("each server in one namespace (--nnodes 1), 3 namespaces", base)
    t2, s2 = summary("each server over two namespaces (--nnodes 2), 5 namespaces", multi)
    print(f"\ncross-node collectives: +{s2 - s1:.2f} ms per decode step (TPOT x{s2 / s1:.2f}), "
          f"TTFT x{t2 / t1:.2f}; load average {os.getloadavg()}")
    return 0 if same else 1


def bench_tp3(args) -> int:
    """The default model's prefill at TP 3 over three namespaces, a TP 1 decode, vs colocated."""
    model = ["--max-total-tokens", "4096"]
    bodies = [greedy(ids, args.max_new, True) for ids in prompts(args.requests, args.prompt_len, 49000)]
    addrs = {"p0": f"{NET}.51", "p1": f"{NET}.52", "p2": f"{NET}.53", "d0": f"{NET}.54", "r": f"{NET}.55"}
    ref = Server("bm-colocated", "null", *model)
    try:
        ref.wait_ready(900)
        want = [ref.post("/generate", dict(b, stream=False), timeout=600).json()["output_ids"] for b in bodies]
    finally:
        ref.stop()
    got = run_cluster("TP 3 prefill over three nodes", addrs, ["p0", "p1", "p2"], ["d0"], 3, 1, args.backend,
                      model, bodies)
    equal = [g["ids"] == w for g, w in zip(got, want)]
    print(f"\ndefault model, prefill --tp-size 3 --nnodes 3 (one rank per namespace), TP 1 decode, "
          f"{args.backend}: greedy output equal to colocated TP 1 for {sum(equal)}/{len(equal)} prompts")
    print("| cluster | requests | TTFT median (ms) | TPOT median (ms) | TPOT p90 (ms) |\n| --- | --- | --- | --- | --- |")
    summary("TP 3 prefill over 3 namespaces + TP 1 decode", got)
    print(f"load average {os.getloadavg()}")
    return 0 if all(equal) else 1


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, choices=(2, 3), default=2)
    ap.add_argument("--backend", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=32)
    args = ap.parse_args()
    print(f"load average at start {os.getloadavg()}", flush=True)
    return bench_tp2(args) if args.tp == 2 else bench_tp3(args)


if __name__ == "__main__":
    sys.exit(main())
