#!/usr/bin/env python
"""Offline throughput: the pdserve Engine vs Hugging Face transformers ``generate``.

Both on the same dequantized weights (pdserve's loader writes them out as an
HF checkpoint that transformers loads) and the same dtype and thread count,
one after the other for each figure; each side (an Engine, or transformers) in
a process of its own (``benchlib.engine_worker``: sides sharing a process slow
each other's OpenMP barriers), so its figures are what a fresh process gets:

- prefill tokens/s: ``--num-prompts`` random prompts of ``--prompt-len`` tokens,
  one new token each (pdserve: one batch, chunked by its scheduler; HF: one
  ``generate`` call on the whole batch, same length so no padding);
- decode tokens/s at 1 and at ``--batch`` concurrent sequences: ``--new-tokens``
  new tokens each after a ``--decode-prompt-len`` prompt, greedy, no early stop;
  new tokens / wall time of the whole call.

Prompts are random token ids from a fixed seed. Ends with one JSON line.

    .venv/bin/python scripts/bench_engine.py            # full: 512-token prompts, 1 and 64 x 128 tokens
    .venv/bin/python scripts/bench_engine.py --quick    # a smoke run in well under a minute

``--server URL`` (or ``--server auto``: launch ``pdserve serve`` with the same
dtype, threads and pool) adds a third side: the same figures measured through
a running engine server's HTTP API (``/generate`` with ``input_ids``; each
decode sequence its own streamed request, so ``--batch`` concurrent streams),
so the API's own overhead shows as ``server_*_vs_engine`` ratios. ``--no-hf``
leaves the transformers side out. ``--quant-sides none w8a16`` adds a pdserve side per listed
weight quantization, so ``--quantization w8a8`` shows its speedup over each as a ratio of the
same run; ``--prefill-only`` measures the prefill figure alone:

    .venv/bin/python scripts/bench_engine.py --no-hf --prefill-only --repeats 5 \
        --quantization w8a8 --quant-sides none w8a16

``--baseline-rev REV`` adds the Engine of an earlier git revision of this checkout as a side
(its files in a temporary tree), so "faster than before" is a ratio of one run (the decode-step
figures of docs/PERFORMANCE.md are against 6fc1355, the last commit before the native decode step):

    .venv/bin/python scripts/bench_engine.py --no-hf --threads 2 --repeats 3 --baseline-rev 6fc1355

``--baseline-tree DIR`` takes that side from another checkout instead (``git worktree add DIR
REV``). With ``--repeats N`` > 1 every ratio also comes per round (the sides alternate A B, B A,
...) as ``{ratio}_median``, ``_min`` and ``_max``: on a shared machine the median of the rounds'
ratios, with its spread, is the figure to report.

Each figure is also given as a fraction of its hardware limit, measured in the
same run (``benchlib.hw_limits``): decode at 1 sequence against weight bytes /
read bandwidth (a 512 MB bf16 sum), prefill and decode at ``--batch`` against
the bf16 GEMM peak / the step's FLOPs. These ``*_frac`` figures, unlike tok/s,
compare across CPUs and survive a loaded machine (the limits see the same load).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package: benchlib by path

from benchlib.ab_rounds import round_ratios, timed  # noqa: E402
from benchlib.baselines import ONEDNN_LINEARS  # noqa: E402
from benchlib.revision_tree import checkout_tree, revision_tree  # noqa: E402
from benchlib.hw_limits import gemm_rate, linear_params, read_bandwidth_gbs, step_flops  # noqa: E402

from pdserve.engine.model_executor.model_runner import cpu_supports_bf16  # noqa: E402
from pdserve.engine.model_executor.layers import can_prepack  # noqa: E402
from pdserve.engine.quantization_names import QUANTIZATIONS, UNQUANTIZED  # noqa: E402
from pdserve.entrypoints.procs import free_port, spawn, stop_group, wait_healthy  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="GGUF file or HF dir; default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="concurrent sequences of the batched decode figure")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="best of N timings per figure (for a noisy machine)")
    p.add_argument("--quick", action="store_true", help="small settings for a smoke run")
    p.add_argument("--server", default=None, help="engine server URL to measure through HTTP, or 'auto' to launch one")
    p.add_argument("--no-hf", action="store_true", help="leave out the transformers side")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="pdserve's weights (EngineConfig)")
    p.add_argument("--baseline", action="store_true",
                   help="add a side 'eager': pdserve with --disable-decode-gemv --disable-native-gemm (and bf16 "
                        "weights), the decode step without native gemv and panel products, with today's other kernels")
    p.add_argument("--baseline-rev", default=None, metavar="REV",
                   help="add a side 'rev': the Engine of git revision REV of this checkout (e.g. 6fc1355, the last "
                        "commit before the native decode step), so the speedup over that code shows as a ratio in the same run; "
                        "with --quantization, in its own int8")
    p.add_argument("--baseline-tree", default=None, metavar="DIR",
                   help="as --baseline-rev, from a checkout at DIR (e.g. made by git worktree add DIR REV) "
                        "rather than a revision of this one")
    p.add_argument("--unfused", action="store_true",
                   help="add a side 'unfused': pdserve with --disable-fused-decode (the same weights, its small "
                        "decode steps op by op from Python), so the fused step's gain shows as a ratio")
    p.add_argument("--quant-sides", nargs="+", default=[], choices=QUANTIZATIONS, metavar="Q",
                   help="add a pdserve side per quantization, named q_<Q> (e.g. --quantization w8a8 "
                        "--quant-sides none w8a16), so pdserve's speedup over each shows as a ratio {fig}_vs_q_<Q>")
    p.add_argument("--prefill-only", action="store_true", help="the prefill figure alone (no decode runs)")
    args = p.parse_args(argv)
    if args.baseline_rev and args.baseline_tree:
        p.error("--baseline-rev and --baseline-tree name the same side: give one")
    if args.quick:
        args.prompt_len, args.num_prompts, args.batch, args.new_tokens = 128, 2, 8, 16
    return args


def random_prompts(n: int, length: int, rng: random.Random, vocab: int) -> list[list[int]]:
    # ids from the middle of the vocabulary: ordinary tokens, no special ones
    lo, hi = min(1000, vocab // 4), vocab - 1
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


# the baseline sides' engine flags over the pdserve side's
BASELINES = {
    "eager": dict(quantization="none", **ONEDNN_LINEARS),  # oneDNN linears only, today's other kernels
    "unfused": dict(disable_fused_decode=True),
}


class PdserveSide:
    """An Engine in a process of its own (``benchlib.engine_worker``); ``pythonpath``: import
    pdserve from there (another revision's tree) rather than this checkout."""

    def __init__(self, args, max_tokens: int, baseline: str | None = None, quantization: str | None = None,
                 pythonpath: str | None = None):
        kwargs = dict(
            model_path=args.model_path,
            dtype=args.dtype,
            num_threads=args.threads,
            max_total_tokens=max_tokens,
            max_running_requests=max(args.batch, 1),
            disable_radix_cache=True,  # every prompt is new anyway; no cache hits between runs
        )
        if pythonpath is None:  # another revision may not know these flags
            kwargs |= {"quantization": quantization or args.quantization, **BASELINES.get(baseline, {})}
        elif args.quantization != UNQUANTIZED:  # the revision's own int8, against this checkout's
            kwargs["quantization"] = args.quantization
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchlib", "engine_worker.py")
        self.proc = subprocess.Popen([sys.executable, worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self._call({"engine": kwargs})

    def _call(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine worker exited with code {self.proc.wait()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"engine worker: {reply['error']}")
        return reply

    def generate(self, prompts, new_tokens):
        sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        return self._call({"generate": {"input_ids": prompts, "sampling_params": sp}})["output_ids"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


class HFSide(PdserveSide):
    """transformers' ``generate`` in a process of its own (``benchlib.engine_worker``), as the
    pdserve sides: its figures are what a fresh process gets."""

    def __init__(self, args, hf_dir: str):
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchlib", "engine_worker.py")
        self.proc = subprocess.Popen([sys.executable, worker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._call({"hf": {"path": hf_dir, "dtype": args.dtype, "threads": args.threads}})


class ServerSide:
    """The same calls through an engine server's HTTP API (``auto``: a server launched for this run)."""

    def __init__(self, args, max_tokens: int):
        import urllib.request

        self.proc = None
        url = args.server
        if url == "auto":
            url = self._launch(args, max_tokens)
        self.url = url.rstrip("/")
        with urllib.request.urlopen(self.url + "/get_server_info", timeout=30) as r:
            info = json.loads(r.read())
        print(f"server {self.url}: dp_size={info.get('dp_size')}, pool {info.get('max_total_num_tokens')} tokens",
              file=sys.stderr)

    def _launch(self, args, max_tokens: int) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "pdserve.engine", "--port", str(port), "--dtype", args.dtype,
               "--max-total-tokens", str(max_tokens), "--max-running-requests", str(max(args.batch, 1)),
               "--disable-radix-cache", "--log-level", "warning"]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        if args.threads:
            cmd += ["--num-threads", str(args.threads)]
        log_path = os.path.join(tempfile.gettempdir(), f"bench-engine-server-{os.getpid()}.log")
        self.proc = spawn(cmd, log_path)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, self.proc, 600, name="pdserve serve", log=lambda: f"see {log_path}", period=0.5)
        return url

    def generate(self, prompts, new_tokens):
        import asyncio

        return asyncio.run(self._generate(prompts, new_tokens))

    async def _generate(self, prompts, new_tokens):
        import asyncio

        import aiohttp

        sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        timeout = aiohttp.ClientTimeout(total=3600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            if new_tokens == 1:  # prefill figure: one batch request, as the engine gets one batch
                async with session.post(self.url + "/generate", json={"input_ids": prompts, "sampling_params": sp}) as r:
                    r.raise_for_status()
                    return [o["output_ids"] for o in await r.json()]

            async def stream(ids):
                last = None
                body = {"input_ids": ids, "sampling_params": sp, "stream": True}
                async with session.post(self.url + "/generate", json=body) as r:
                    r.raise_for_status()
                    async for line in r.content:
                        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                            last = line
                return json.loads(last[len(b"data: ") :])["output_ids"]

            return await asyncio.gather(*(stream(p) for p in prompts))

    def close(self):
        if self.proc is not None:
            stop_group(self.proc)


def export_hf(model_path: str | None, out_dir: str) -> tuple[int, object]:
    from pdserve.engine.model_executor.model_loader import load_model, save_hf_checkpoint

    arch, weights, _ = load_model(model_path)
    save_hf_checkpoint(arch, weights, out_dir)
    return arch.vocab_size, arch


def match_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            total += 1
            same += s == t
            if s != t:
                break  # after the first divergence the sequences are not comparable
    return same / max(total, 1)


def hardware_limits(args, arch) -> dict[str, float]:
    """Limits in tok/s for each figure, from this run's measured bandwidth and GEMM peak: the best of
    several short measurements, since on a shared machine any one of them may be a loaded moment."""
    bw = read_bandwidth_gbs(repeats=10)
    # the dtype pdserve's large steps multiply in: bf16 is upcast to float32 where it cannot run
    # prepacked (KernelPlan.upcast)
    bf16 = args.dtype == "bfloat16" and can_prepack(torch.bfloat16, torch.device("cpu"), cpu_supports_bf16())
    mm_dtype = torch.bfloat16 if bf16 else torch.float32
    peak = gemm_rate(2048, repeats=10, dtype=mm_dtype)
    # the pdserve side's weights: w8a16 and w8a8 read one byte per weight (their float32 scales, one
    # per row, are < 1% more)
    dense_bytes = linear_params(arch) * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    weight_bytes = linear_params(arch) if args.quantization != UNQUANTIZED else dense_bytes
    prefill_flops = step_flops(arch, args.prompt_len, 0, 1)  # per prompt
    # decode at --batch: the mean context over the run
    decode_flops = step_flops(arch, 1, args.decode_prompt_len + args.new_tokens // 2, 1)  # per token
    print(f"limits: read {bw:.1f} GB/s, {str(mm_dtype).removeprefix('torch.')} GEMM {peak:.0f} GFLOP/s, "
          f"{weight_bytes / 1e6:.0f} MB of weights per decode step, load average {os.getloadavg()[0]:.1f}",
          file=sys.stderr)
    return {
        "read_gbs": bw,
        "gemm_gflops": peak,
        "weight_mb": weight_bytes / 1e6,
        "limit_prefill_tok_s": peak * 1e9 * args.prompt_len / prefill_flops,
        "limit_decode1_tok_s": bw * 1e9 / weight_bytes,
        "limit_decode1_dense_tok_s": bw * 1e9 / dense_bytes,  # the sides with weights in dtype
        f"limit_decode{args.batch}_tok_s": peak * 1e9 / decode_flops,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as hf_dir:
        t0 = time.perf_counter()
        vocab, arch = export_hf(args.model_path, hf_dir)
        print(f"exported dequantized weights in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        prefill_prompts = random_prompts(args.num_prompts, args.prompt_len, rng, vocab)
        decode_prompts = random_prompts(args.batch, args.decode_prompt_len, rng, vocab)
        warm = random_prompts(2, 16, rng, vocab)
        max_tokens = max(
            args.num_prompts * (args.prompt_len + 16),
            args.batch * (args.decode_prompt_len + args.new_tokens + 16),
        )
        sides = {"pdserve": PdserveSide(args, max_tokens)}
        if args.baseline:
            sides["eager"] = PdserveSide(args, max_tokens, baseline="eager")
        if args.unfused:
            sides["unfused"] = PdserveSide(args, max_tokens, baseline="unfused")
        if args.baseline_rev or args.baseline_tree:
            dest = os.path.join(hf_dir, "rev")
            if args.baseline_tree:
                tree = checkout_tree(args.baseline_tree, dest)
            else:
                repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                tree = revision_tree(repo, args.baseline_rev, dest)
            sides["rev"] = PdserveSide(args, max_tokens, pythonpath=tree)
        for q in args.quant_sides:
            sides[f"q_{q}"] = PdserveSide(args, max_tokens, quantization=q)
        if not args.no_hf:
            sides["hf"] = HFSide(args, hf_dir)
        if args.server:
            sides["server"] = ServerSide(args, max_tokens)
        figures: dict[str, float] = {}
        round_times: dict[str, list[float]] = {}  # "{side}_{fig}" -> each round's seconds
        outputs: dict[str, dict[str, list]] = {name: {} for name in sides}
        for name, side in sides.items():
            side.generate(warm, 4)  # warm-up: first-call allocations, kernel selection
        for name, (_, dt, ts) in timed(sides, lambda side: side.generate(prefill_prompts, 1), args.repeats).items():
            figures[f"{name}_prefill_tok_s"] = args.num_prompts * args.prompt_len / dt
            round_times[f"{name}_prefill"] = ts
            print(f"{name:8s} prefill {args.num_prompts}x{args.prompt_len}: {dt:.2f}s", file=sys.stderr)
        for conc in () if args.prefill_only else (1, args.batch):
            runs = timed(sides, lambda side: side.generate(decode_prompts[:conc], args.new_tokens), args.repeats)
            for name, (out, dt, ts) in runs.items():
                outputs[name][conc] = out
                figures[f"{name}_decode{conc}_tok_s"] = conc * args.new_tokens / dt
                round_times[f"{name}_decode{conc}"] = ts
                print(f"{name:8s} decode  {conc}x{args.new_tokens}: {dt:.2f}s", file=sys.stderr)
        for side in sides.values():
            side.close()
        limits = hardware_limits(args, arch)  # after the sides are closed: nothing else running
    result = {
        "bench": "engine",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "num_prompts": args.num_prompts,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "quantization": args.quantization,
        **{k: round(v, 1) for k, v in figures.items()},
        **{k: round(v, 1) for k, v in limits.items()},
        "load_avg": round(os.getloadavg()[0], 1),
    }
    figs = ("prefill",) if args.prefill_only else ("prefill", "decode1", f"decode{args.batch}")
    # the sides whose weights are int8: pdserve and unfused with args.quantization, q_<Q> with Q
    int8 = {name for name in sides if name in ("pdserve", "unfused") and args.quantization != UNQUANTIZED}
    int8 |= {f"q_{q}" for q in args.quant_sides if q != UNQUANTIZED}

    def limit(name: str, fig: str) -> float:
        dense = fig == "decode1" and name not in int8
        return limits["limit_decode1_dense_tok_s" if dense else f"limit_{fig}_tok_s"]

    for name in sides:
        for fig in figs:
            result[f"{name}_{fig}_frac"] = round(figures[f"{name}_{fig}_tok_s"] / limit(name, fig), 3)
    rows = []
    for other in ("hf", "server", "eager", "rev", "unfused", *(f"q_{q}" for q in args.quant_sides)):
        if other not in sides:
            continue
        for fig in figs:
            # hf: pdserve engine / hf;  server: server / pdserve engine (the HTTP API's overhead);
            # eager: pdserve / pdserve with oneDNN linears only (the native decode step's speedup);
            # rev: pdserve / --baseline-rev's (or --baseline-tree's) code;
            # unfused: pdserve / its steps op by op;
            # q_<Q>: pdserve / pdserve with weights Q
            num, den = ("server", "pdserve") if other == "server" else ("pdserve", other)
            key = {"hf": f"{fig}_ratio", "server": f"server_{fig}_vs_engine"}.get(other, f"{fig}_vs_{other}")
            result[key] = round(figures[f"{num}_{fig}_tok_s"] / figures[f"{den}_{fig}_tok_s"], 3)
            if args.repeats > 1:  # the same ratio round by round: its median and spread
                for stat, v in round_ratios(round_times[f"{num}_{fig}"], round_times[f"{den}_{fig}"]).items():
                    result[f"{key}_{stat}"] = round(v, 3)
            rows.append((fig, num, den, key))
    if "hf" in sides and not args.prefill_only:
        # greedy tokens agreeing with HF up to each sequence's first divergence (bf16 near-ties may flip)
        result["greedy_match"] = round(match_fraction(outputs["pdserve"][args.batch], outputs["hf"][args.batch]), 3)
    if "server" in sides and not args.prefill_only:
        result["server_greedy_match"] = round(
            match_fraction(outputs["server"][args.batch], outputs["pdserve"][args.batch]), 3
        )
    print(f"{'figure':24s} {'side':>8s} {'tok/s':>10s} {'base':>8s} {'tok/s':>10s} {'ratio':>7s}"
          f"{'  median (min-max) of rounds' if args.repeats > 1 else ''}", file=sys.stderr)
    for fig, num, den, key in rows:
        spread = (f"  {result[f'{key}_median']:.3f} ({result[f'{key}_min']:.3f}-{result[f'{key}_max']:.3f})"
                  if args.repeats > 1 else "")
        print(f"{fig:24s} {num:>8s} {result[f'{num}_{fig}_tok_s']:10.1f} {den:>8s} "
              f"{result[f'{den}_{fig}_tok_s']:10.1f} {result[key]:7.2f}{spread}", file=sys.stderr)
    for name in sides:
        print(f"{name:8s} fraction of limit: " + ", ".join(
            f"{fig} {result[f'{name}_{fig}_frac']:.2f} of {limit(name, fig):.0f} tok/s" for fig in figs),
            file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
