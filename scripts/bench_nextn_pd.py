#!/usr/bin/env python
"""NEXTN through PD: a tiny DeepSeek-V3 served 1 prefill + 1 decode against colocated, TTFT and TPOT.

The checkpoint is made here (``tests/support/deepseek_util.py``, transformers): a one-layer
DeepSeek-V3 (MLA, q LoRA, sigmoid routing) whose MTP layer copies its layer, so NEXTN's drafts are
mostly right. Four setups, each taking ``--concurrency`` (16) requests in flight, greedy, exactly
``--output-len`` tokens of random prompts of ``--input-len`` token ids, on the project's serving
client (``bench_serving.benchmark``, the mean TTFT, TPOT and end-to-end latency of a run; on a model
this small a decode of 32 tokens takes a few ms, so under load a PD stream's tokens can reach the
client together and TPOT is noisy: e2e is the steadier figure):

- colocated, speculation off and ``--speculative-algorithm NEXTN``;
- 1P1D behind the pdserve router, off and NEXTN: a prefill and a decode server each, both started
  with NEXTN in the second (the prefill hands the prompt's last hidden state over with the first
  token), a router in front of each pair.

The setups take turns each repeat (the order rotating), so the machine's drift hits them alike;
each figure is the median over ``--repeats``. Prints each run, the NEXTN servers' draft price (a draft
step in target steps, measured at start) and accept counters, a table with the ratios 1P1D /
colocated, and one JSON line. On this one-layer model a draft step costs about a target step, so
the adaptive rule may verify no draft at all: the figures then price the hand-off path itself.

    .venv/bin/python scripts/bench_nextn_pd.py              # 3 repeats
    .venv/bin/python scripts/bench_nextn_pd.py --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # scripts/ is not a package: benchlib and bench_spec by path
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the tests' checkpoint builder

import uvloop  # noqa: E402
from bench_serving import benchmark  # noqa: E402
from bench_spec import Proc, print_counters, router, spec_counters  # noqa: E402
from benchlib.client import GenerateBackend  # noqa: E402
from benchlib.datasets import DatasetRow  # noqa: E402
from benchlib.metrics import calculate_metrics  # noqa: E402

from pdserve.entrypoints.procs import free_port  # noqa: E402

PY = sys.executable
NEXTN = ["--speculative-algorithm", "NEXTN"]
SETUPS = ("colocated off", "colocated NEXTN", "1P1D off", "1P1D NEXTN")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="per run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft-tokens", type=int, default=3, help="NEXTN's --speculative-num-draft-tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--backend", default="mooncake", help="the 1P1D KV transfer backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=f"/tmp/bench_nextn_pd_{os.getpid()}")
    return p.parse_args(argv)


def make_checkpoint(path: str) -> None:
    from support.deepseek_util import add_mtp_layer, make_deepseek_checkpoint

    make_deepseek_checkpoint("v3", path, num_hidden_layers=1, first_k_dense_replace=2)
    add_mtp_layer(path, copy_last=True)


def server(name: str, args, model: str, mode: str = "null", extra: list[str] = ()) -> tuple[Proc, int | None]:
    port = free_port()
    # NEXTN's servers at info: their log says what a draft step costs (the adaptive rule's price)
    cmd = [PY, "-m", "pdserve.engine", "--model-path", model, "--port", str(port), "--dtype", "float32",
           "--num-threads", str(args.threads), "--max-total-tokens", "16384",
           "--log-level", "info" if NEXTN[1] in extra else "warning", "--disaggregation-mode", mode]
    bootstrap = None
    if mode != "null":
        cmd += ["--disaggregation-transfer-backend", args.backend]
    if mode == "prefill":
        bootstrap = free_port()
        cmd += ["--disaggregation-bootstrap-port", str(bootstrap)]
    if NEXTN[1] in extra:
        cmd += ["--speculative-num-draft-tokens", str(args.draft_tokens)]
    return Proc(name, cmd + list(extra), args.logs, f"http://127.0.0.1:{port}"), bootstrap


def draft_price(log: str) -> str:
    """The NEXTN proposer's start-up line: what one draft step costs in target decode steps."""
    with open(log, errors="replace") as f:
        found = re.search(r"a draft step costs ([0-9.]+) of the target's", f.read())
    return f"a draft step costs {found.group(1)} target steps" if found else "draft price not logged"


def rows(args, n: int, seed: int) -> list[DatasetRow]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = tuple(rng.randrange(3, 512) for _ in range(args.input_len))
        out.append(DatasetRow(prompt=" ".join(f"t{i}" for i in ids), prompt_len=len(ids), output_len=args.output_len,
                              prompt_ids=ids))
    return out


def run(url: str, sent: list[DatasetRow], concurrency: int) -> dict[str, float]:
    outputs, duration = uvloop.run(benchmark(url, GenerateBackend(), sent, [0.0] * len(sent),
                                             max_concurrency=concurrency))
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) to {url} failed: {failed[0]}")
    m = calculate_metrics(outputs, duration)
    return {"ttft": m["mean_ttft_ms"], "tpot": m["mean_tpot_ms"], "e2e": m["mean_e2e_latency_ms"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.logs, exist_ok=True)
    model = tempfile.mkdtemp(prefix="bench_nextn_pd_")
    make_checkpoint(model)
    load = os.getloadavg()
    t0 = time.time()
    print(f"bench_nextn_pd: {args.requests} requests at {args.concurrency} in flight, {args.input_len} -> "
          f"{args.output_len} tokens, {args.repeats} repeat(s), {args.threads} thread(s) per server, backend "
          f"{args.backend}, logs in {args.logs}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    colo_off, _ = server("colocated_off", args, model)
    colo_nextn, _ = server("colocated_nextn", args, model, extra=NEXTN)
    p_off, boot_off = server("pd_prefill_off", args, model, "prefill")
    p_nextn, boot_nextn = server("pd_prefill_nextn", args, model, "prefill", NEXTN)
    d_off, _ = server("pd_decode_off", args, model, "decode")
    d_nextn, _ = server("pd_decode_nextn", args, model, "decode", NEXTN)
    procs = [colo_off, colo_nextn, p_off, p_nextn, d_off, d_nextn]
    got: dict[str, list[dict[str, float]]] = {}
    try:
        for p in procs:
            p.wait()
        r_off, r_nextn = (router(f"pd_router_{n}", args, p, boot, d) for n, p, boot, d in
                          (("off", p_off, boot_off, d_off), ("nextn", p_nextn, boot_nextn, d_nextn)))
        procs += [r_off, r_nextn]
        for p in (r_off, r_nextn):
            p.wait(120)
        urls = dict(zip(SETUPS, (colo_off.url, colo_nextn.url, r_off.url, r_nextn.url)))
        for url in urls.values():  # warm-up: every shape once, prompts not measured
            run(url, rows(args, args.concurrency, seed=args.seed + 1000), args.concurrency)
        for r in range(args.repeats):
            sent = rows(args, args.requests, seed=args.seed + r)
            names = list(SETUPS)
            for name in names[r % 4:] + names[: r % 4]:
                m = run(urls[name], sent, args.concurrency)
                got.setdefault(name, []).append(m)
                print(f"  repeat {r} {name:>16}: TTFT {m['ttft']:.1f} ms, TPOT {m['tpot']:.2f} ms, "
                      f"e2e {m['e2e']:.1f} ms", flush=True)
        for label, p in (("colocated NEXTN", colo_nextn), ("1P1D decode NEXTN", d_nextn)):
            print(f"  {label}: {draft_price(p.log)}; counters {spec_counters(p.url)}", flush=True)
            print_counters(label, spec_counters(p.url))
    finally:
        for p in reversed(procs):
            p.stop()
    keys = ("ttft", "tpot", "e2e")
    med = {name: {k: statistics.median(m[k] for m in runs) for k in keys} for name, runs in got.items()}
    def spread(name: str, k: str, fmt: str) -> str:
        values = [m[k] for m in got[name]]
        return f"{med[name][k]:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    print("\n| setup | TTFT ms, median (min-max) | TPOT ms | e2e ms | TTFT x colocated | TPOT x col. | e2e x col. |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in SETUPS:
        base = med[name.replace("1P1D", "colocated")]
        print(f"| {name} | {spread(name, 'ttft', '.1f')} | {spread(name, 'tpot', '.2f')} | {spread(name, 'e2e', '.1f')} | "
              + " | ".join(f"{med[name][k] / base[k]:.2f}" for k in keys) + " |")
    nextn = {k: med["1P1D NEXTN"][k] / med["colocated NEXTN"][k] for k in keys}
    print(json.dumps({"bench": "nextn_pd", "median": med, "pd_over_colocated_nextn": nextn,
                      "seconds": round(time.time() - t0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
