#!/usr/bin/env python
"""Decode tokens/s with a JSON schema against unconstrained decoding, at 1 and 16 streams, same run.

The offline Engine (in this process) generates ``--new-tokens`` tokens per
stream, greedy, after a short chat-style prompt:

- unconstrained: ``ignore_eos`` so every stream runs the full length;
- constrained: ``json_schema`` of a list of records that asks for more items
  than fit (``minItems``), so every stream also runs the full length, each
  step masking the logits with the grammar's bitmask (filled on a worker thread
  while the forward runs) and advancing each stream's matcher.

So both sides produce the same number of tokens; the ratio
constrained / unconstrained tokens/s is the cost of structured output. Rounds
alternate the two sides (``--rounds``; the medians are reported, and the ratio
of the best rounds, the least disturbed by other load on a shared machine) so
that a change of load hits both alike. A warm-up request of each
kind runs first (xgrammar's import and the schema's compilation are one-time
costs, not per-token ones). Ends with one JSON line; target: ratio >= 0.85 at
16 streams.

    .venv/bin/python scripts/bench_structured.py
    .venv/bin/python scripts/bench_structured.py --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pdserve.entrypoints.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 1000, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                       "member": {"type": "boolean"}},
        "required": ["name", "age", "member"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}
PROMPT = "List the members of the chess club as JSON records."


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="GGUF file or HF dir; default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="32 tokens, 1 round")
    return p.parse_args(argv)


def run(engine: Engine, streams: int, new_tokens: int, schema: str | None) -> tuple[float, float]:
    """Tokens per second of wall clock and per second of this process's CPU time (all its
    threads), for ``streams`` concurrent greedy sequences of ``new_tokens`` tokens each."""
    sp = {"temperature": 0, "max_new_tokens": new_tokens}
    sp.update({"json_schema": schema} if schema else {"ignore_eos": True})
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate([PROMPT] * streams, [sp] * streams)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert tokens == streams * new_tokens, f"a stream ended early: {tokens} of {streams * new_tokens} tokens"
    return tokens / elapsed, tokens / cpu


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.new_tokens, args.rounds = 32, 1
    kw = {"num_threads": args.threads} if args.threads else {}
    engine = Engine(args.model_path, dtype=args.dtype, **kw)
    schema = json.dumps(SCHEMA)
    try:
        run(engine, 1, 4, None)
        run(engine, 1, 4, schema)  # xgrammar's import, the vocabulary's index, the schema's compilation
        result = {"new_tokens": args.new_tokens, "rounds": args.rounds, "dtype": args.dtype}
        for n in args.streams:
            free, constrained, free_cpu, constrained_cpu = [], [], [], []
            for _ in range(args.rounds):
                for side, side_cpu, s in ((free, free_cpu, None), (constrained, constrained_cpu, schema)):
                    wall, cpu = run(engine, n, args.new_tokens, s)
                    side.append(wall)
                    side_cpu.append(cpu)
            f, c = statistics.median(free), statistics.median(constrained)
            # tokens per CPU-second: what the grammar work costs, less sensitive to other processes
            result[f"cpu_ratio_{n}"] = round(statistics.median(constrained_cpu) / statistics.median(free_cpu), 3)
            result[f"unconstrained_tok_s_{n}"] = round(f, 1)
            result[f"json_schema_tok_s_{n}"] = round(c, 1)
            result[f"ratio_{n}"] = round(c / f, 3)
            # best round of each side: the least disturbed by other load on a shared machine
            result[f"best_ratio_{n}"] = round(max(constrained) / max(free), 3)
            print(f"{n:>3} streams: unconstrained {f:8.1f} tok/s, json_schema {c:8.1f} tok/s (medians), "
                  f"ratio {c / f:.3f}, best rounds {result[f'best_ratio_{n}']:.3f}, "
                  f"per CPU-second {result[f'cpu_ratio_{n}']:.3f}; rounds: "
                  f"{[round(x) for x in free]} vs {[round(x) for x in constrained]}", flush=True)
    finally:
        engine.shutdown()
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
