"""Data-parallel attention against its alternatives on this machine's cores, through the offline
Engine on the default model (SmolLM2-135M: 9 heads, which TP 2 cannot split; DP attention's
groups hold whole heads, so it can): one batch of ``--batch`` prompts of ``--prompt-len`` random
tokens, ``--new-tokens`` each, greedy.

Configurations: ``tp1`` (one rank), ``dp2`` (two replicas, ``--dp-size 2``), ``dpattn2``
(``--tp-size 2 --dp-size 2 --enable-dp-attention``: two attention groups, the MLPs split over
both). Each runs in fresh processes, one warm-up batch first; reports the batch's wall seconds,
output tokens per second and the weights each rank holds (KV pool per rank at a fixed
``--max-total-tokens``). Ends with one JSON summary line.

Figures: docs/PERFORMANCE.md, "Data-parallel attention on one machine".

    .venv/bin/python scripts/bench_dp_attention.py [--batch 16] [--prompt-len 64] [--new-tokens 32] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pdserve.entrypoints.engine import Engine

CONFIGS = {
    "tp1": {},
    "dp2": {"dp_size": 2},
    "dpattn2": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True},
}


def run(flags: dict, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict:
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with Engine(dtype=dtype, max_total_tokens=8192, **flags) as engine:
        engine.generate(input_ids=prompts[:2], sampling_params=sp)  # warm-up
        t0 = time.perf_counter()
        out = engine.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
        info = engine.get_server_info()
    tokens = sum(len(o["output_ids"]) for o in out)
    return {"wall_s": round(wall, 2), "output_tok_s": round(tokens / wall, 1),
            "kv_pool_bytes": info["kv_pool_bytes"], "outputs": [o["output_ids"] for o in out]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    results = {}
    for name in args.configs.split(","):
        results[name] = run(CONFIGS[name], prompts, args.new_tokens, args.dtype)
        print(name, {k: v for k, v in results[name].items() if k != "outputs"}, flush=True)
    ref = results[next(iter(results))]["outputs"]
    summary = {name: {k: v for k, v in r.items() if k != "outputs"} | {"same_as_first": r["outputs"] == ref}
               for name, r in results.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
