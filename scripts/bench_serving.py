"""Online serving benchmark: TTFT, TPOT, ITL, latency, throughput and goodput at the client.

Like SGLang's ``bench_serving.py`` (same metric names in its JSON), for a
pdserve server, a pdserve router in front of prefill/decode servers, or an
SGLang server. Every request is streamed, asks for exactly its output length
(greedy, EOS ignored) and is timed token by token at the client.

    .venv/bin/python scripts/bench_serving.py --base-url http://127.0.0.1:30000 \\
        --backend chat --dataset random --random-input-len 256 --random-output-len 64 \\
        --num-prompts 100 --request-rate 4 --slo-ttft-ms 500 --slo-tpot-ms 100 \\
        --output-file bench.jsonl --plot plots/

Workloads (``--dataset``): ``random`` token ids of the model's vocabulary,
``sharegpt`` (a ShareGPT JSON file), ``shared-prefix`` (groups of prompts
sharing a long system prompt; ``--num-prompts`` is ignored there: the count is
groups x prompts per group; SGLang's ``--gsp-*`` spellings are accepted),
``multi-turn`` (``--mt-conversations`` conversations of ``--mt-turns`` turns, each
prompt the whole history, earlier answers included, plus a new message; see
"Multi-turn" below).
``random`` and ``shared-prefix`` send token ids where the API takes them
(generate, completions), so the server sees exactly the lengths asked; chat
sends their text. Arrivals: Poisson at ``--request-rate`` (``inf``: all at
once), at most ``--max-concurrency`` in flight. In the JSON line an infinite
rate is written as the string ``"inf"`` (standard JSON has no Infinity).

Output: a tqdm bar, a summary table, then one summary line. ``--output-file``
appends one JSON line per run (the arguments and every metric);
``--output-details`` adds the per-request arrays; ``--plot DIR`` writes
ttft_cdf.png, tpot_cdf.png and timeline.png.

Multi-turn (``--dataset multi-turn``, the ``generate`` backend: the history is the
server's own answer ids): a turn's requests go together, then ``--mt-think-time``
seconds, then the next turn. Messages are generated random ids (``--mt-message-len``
tokens; with ``--random-range-ratio R`` > 0, uniform in [len * R, len]) or, with
``--dataset-path``, the human turns of a ShareGPT file's multi-turn conversations. Reported: the hit rate against the ideal (every
earlier turn's tokens cached, page-aligned) from the responses'
``meta_info.cached_tokens`` (the OpenAI APIs' ``usage.prompt_tokens_details.cached_tokens``),
prompt tokens computed, p50 TTFT by turn, and from each ``--metrics-url`` server's
``/metrics`` (default: ``--base-url``; behind a router, name the prefill servers) the
cached tokens per tier (``pdserve_cached_tokens_total``, ``pdserve_hicache_hit_tokens_total``)
and the KV bytes sent to decode. ``run_multi_turn(args, convs=None) -> dict``.

Shared fleets: ``--tenants N`` spreads the requests over tenants ``tenant-0`` .. ``tenant-{N-1}``
named by the header ``--tenant-header-name`` (default ``x-tenant``: start the router with
``--tenant-header x-tenant``), in proportion to ``--tenant-weights`` (equal by default);
``--priority-mix 10:0.2,0:0.8`` sends 20 % of them at priority 10 (header ``x-pdserve-priority``
and body ``priority``: the router and the servers need ``--enable-priority-scheduling``). The
table, the JSON line (``by_tenant``, ``by_priority``) and a summary line per group give TTFT, TPOT
and goodput per tenant and per priority (``benchlib/traffic_mix.py``).

Importable: ``parse_args(argv)``, ``run_benchmark(args, rows=None) -> dict``,
``benchmark(...)`` (async, the load generator) and ``build_rows(args, tokenizer)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ is not a package: benchlib by path

from benchlib import datasets  # noqa: E402
from benchlib.client import BACKENDS, Backend, send_request  # noqa: E402
from benchlib.datasets import DatasetRow  # noqa: E402
from benchlib.metrics import RequestOutput, calculate_metrics, error_counts, format_table  # noqa: E402
from benchlib.traffic_mix import (DEFAULT_TENANT_HEADER, RequestTag, assign_tags, format_groups,  # noqa: E402
                                  group_metrics, parse_priority_mix, parse_tenant_weights)

DETAIL_KEYS = (
    "input_lens", "output_lens", "expected_output_lens", "ttfts", "tpots", "itls",
    "e2e_latencies", "start_times", "errors", "generated_texts",
)
WARMUP_MAX_TOKENS = 16


class BenchmarkError(RuntimeError):
    """The benchmark could not run (server unreachable, warmup failed)."""


# --- arguments ---------------------------------------------------------------------------------


def _rate(text: str) -> float:
    try:
        return float(text)  # float() takes "inf" too
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'inf': {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        description="Benchmark an LLM server's streaming latency and throughput (SGLang bench_serving metrics).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:30000", help="server or router URL")
    g.add_argument("--backend", choices=sorted(BACKENDS), default="generate",
                   help="generate: /generate (pdserve/SGLang native); completions: /v1/completions; "
                        "chat: /v1/chat/completions")
    g.add_argument("--model", default=None,
                   help="model name sent to OpenAI endpoints; default: the first of GET /v1/models")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", dest="dataset_name",
                   choices=["random", "sharegpt", "shared-prefix", "multi-turn"], default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (sharegpt)")
    g.add_argument("--model-path", default=None,
                   help="model whose tokenizer makes and measures prompts; default: the default model")
    g.add_argument("--tokenizer", default=None, help="tokenizer path, if not --model-path's")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * ratio, len]; 1.0: all exactly len")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="ask every ShareGPT request for this many tokens instead of its reply's length")
    g.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="drop ShareGPT pairs longer than this (default: prompt > 1024 or pair > 2048)")
    g.add_argument("--sp-num-groups", "--gsp-num-groups", type=int, default=8)
    g.add_argument("--sp-prompts-per-group", "--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--sp-system-prompt-len", "--gsp-system-prompt-len", type=int, default=1024)
    g.add_argument("--sp-question-len", "--gsp-question-len", type=int, default=64)
    g.add_argument("--sp-output-len", "--gsp-output-len", type=int, default=128)
    g.add_argument("--mt-conversations", type=int, default=8, help="multi-turn: conversations")
    g.add_argument("--mt-turns", type=int, default=4, help="multi-turn: turns of each")
    g.add_argument("--mt-message-len", type=int, default=64, help="multi-turn: tokens of each new message")
    g.add_argument("--mt-answer-len", type=int, default=32, help="multi-turn: tokens of each answer")
    g.add_argument("--mt-think-time", type=float, default=0.0, help="multi-turn: seconds between turns")
    g.add_argument("--mt-page-size", type=int, default=16, help="multi-turn: the servers' page size (the ideal)")
    g.add_argument("--metrics-url", action="append", default=[],
                   help="multi-turn: a server whose /metrics to read (repeat; default: --base-url)")
    g.add_argument("--seed", type=int, default=1)

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrival rate in requests/s; inf: send all at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--warmup-requests", type=int, default=1,
                   help=f"requests sent (and not measured) before the run, at most {WARMUP_MAX_TOKENS} tokens each")

    g = p.add_argument_group("shared fleet")
    g.add_argument("--tenants", type=int, default=0,
                   help="spread the requests over N tenants (tenant-0 ..), named by --tenant-header-name")
    g.add_argument("--tenant-header-name", default=DEFAULT_TENANT_HEADER,
                   help="the header naming a request's tenant (the router's --tenant-header)")
    g.add_argument("--tenant-weights", default=None,
                   help="comma-separated share of the requests per tenant, e.g. 8,1,1 (default: equal)")
    g.add_argument("--priority-mix", default=None, metavar="P1:F1,P2:F2",
                   help="fraction of the requests per priority (header x-pdserve-priority and body priority)")
    g.add_argument("--priority-header", action=argparse.BooleanOptionalAction, default=True,
                   help="send x-pdserve-priority (off: the body's priority only, for a router without "
                        "--enable-priority-scheduling, which refuses the header)")

    g = p.add_argument_group("output")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    g.add_argument("--output-file", default=None, help="append one JSON line per run")
    g.add_argument("--output-details", action="store_true", help="add per-request arrays to the JSON line")
    g.add_argument("--plot", default=None, metavar="DIR", help="write CDF and timeline PNGs into DIR")
    g.add_argument("--tag", default=None, help="free text stored in the JSON line")
    g.add_argument("--disable-tqdm", action="store_true")
    return p


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (exit 2, usage and message) on any argument that cannot work."""
    if not args.base_url.startswith(("http://", "https://")):
        p.error(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    if math.isnan(args.request_rate) or args.request_rate <= 0:
        p.error(f"--request-rate must be > 0 (or inf), got {args.request_rate:g}")
    if args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.warmup_requests < 0:
        p.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if args.request_timeout <= 0:
        p.error(f"--request-timeout must be > 0, got {args.request_timeout:g}")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {v:g}")
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            p.error("--dataset sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)")
        if not os.path.isfile(args.dataset_path):
            p.error(f"--dataset-path: no such file: {args.dataset_path}")
        for name in ("sharegpt_output_len", "sharegpt_context_len"):
            v = getattr(args, name)
            if v is not None and v < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    elif args.dataset_path and not os.path.isfile(args.dataset_path):
        p.error(f"--dataset-path: no such file: {args.dataset_path}")
    if args.dataset_name == "random":
        for name in ("random_input_len", "random_output_len"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if not 0.0 <= args.random_range_ratio <= 1.0:
            p.error(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio:g}")
    if args.dataset_name == "multi-turn":
        if args.backend != "generate":
            p.error("--dataset multi-turn needs --backend generate (the history is the server's answer ids)")
        for name in ("mt_conversations", "mt_turns", "mt_message_len", "mt_answer_len", "mt_page_size"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.mt_think_time < 0:
            p.error(f"--mt-think-time must be >= 0, got {args.mt_think_time:g}")
        for u in args.metrics_url:
            if not u.startswith(("http://", "https://")):
                p.error(f"--metrics-url must start with http:// or https://, got {u!r}")
    if args.tenants < 0:
        p.error(f"--tenants must be >= 0, got {args.tenants}")
    if args.tenant_weights is not None and not args.tenants:
        p.error("--tenant-weights needs --tenants N")
    if not args.tenant_header_name or any(c in args.tenant_header_name for c in " :\r\n"):
        p.error(f"--tenant-header-name must be an HTTP header name, got {args.tenant_header_name!r}")
    try:
        args.tenant_weight_list = (parse_tenant_weights(args.tenant_weights, args.tenants)
                                   if args.tenant_weights is not None else None)
        args.priority_mix_list = parse_priority_mix(args.priority_mix) if args.priority_mix else None
    except ValueError as exc:
        p.error(str(exc))
    if (args.tenants or args.priority_mix) and args.dataset_name == "multi-turn":
        p.error("--tenants and --priority-mix apply to --dataset random, sharegpt and shared-prefix")
    if args.dataset_name == "shared-prefix":
        for name in ("sp_num_groups", "sp_prompts_per_group", "sp_system_prompt_len", "sp_question_len",
                     "sp_output_len"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    validate(p, args)
    return args


# --- workload ----------------------------------------------------------------------------------


def load_tokenizer_for(args: argparse.Namespace):
    from pdserve.engine.text.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer or args.model_path)


def build_rows(args: argparse.Namespace, tokenizer) -> list[DatasetRow]:
    """The workload the arguments describe."""
    if args.dataset_name == "random":
        return datasets.sample_random(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.seed)
    if args.dataset_name == "sharegpt":
        rows = datasets.sample_sharegpt(tokenizer, args.dataset_path, args.num_prompts, args.seed,
                                        args.sharegpt_output_len, args.sharegpt_context_len)
        if not rows:
            raise BenchmarkError(f"{args.dataset_path}: no usable conversation (need a human and a gpt turn, "
                                 "each of 2+ tokens, within the context length)")
        return rows
    return datasets.sample_shared_prefix(tokenizer, args.sp_num_groups, args.sp_prompts_per_group,
                                         args.sp_system_prompt_len, args.sp_question_len, args.sp_output_len,
                                         args.seed)


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``n`` Poisson arrivals; all 0 at rate inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps).tolist()


# --- the run -----------------------------------------------------------------------------------


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str, headers: dict) -> str | None:
    """The first model id of GET /v1/models, or None when the server has no such endpoint."""
    try:
        async with session.get(base_url + "/v1/models", headers=headers) as r:
            if r.status == 200:
                data = (await r.json()).get("data") or []
                return data[0].get("id") if data else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
        pass
    return None


async def benchmark(
    base_url: str,
    backend: Backend,
    rows: list[DatasetRow],
    offsets: list[float],
    *,
    model: str | None = None,
    max_concurrency: int | None = None,
    warmup_requests: int = 0,
    headers: dict | None = None,
    request_timeout: float = 3600.0,
    disable_tqdm: bool = True,
    tags: list[RequestTag] | None = None,
    tenant_header: str = DEFAULT_TENANT_HEADER,
    priority_header: bool = True,
) -> tuple[list[RequestOutput], float]:
    """Send ``rows[i]`` at ``offsets[i]`` seconds after the start (later if
    ``max_concurrency`` requests are in flight); returns the outputs in row order
    and the run's duration (start to last completion). Warmup requests go first,
    are not measured, and must not all fail. ``tags[i]``: the tenant and priority
    ``rows[i]`` is sent with (warmup requests go untagged)."""
    from tqdm import tqdm

    timeout = aiohttp.ClientTimeout(total=request_timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
        if backend.openai and model is None:
            model = await fetch_model_name(session, base_url, headers or {})
        if warmup_requests:
            t0 = time.perf_counter()
            warm = await asyncio.gather(*(
                send_request(session, base_url, backend, rows[i % len(rows)], model, t0,
                             output_len=min(WARMUP_MAX_TOKENS, rows[i % len(rows)].output_len), headers=headers)
                for i in range(warmup_requests)
            ))
            if not any(o.success for o in warm):
                raise BenchmarkError(f"every warmup request failed; first error: {warm[0].error}")

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(rows), disable=disable_tqdm, desc="requests", file=sys.stderr)
        start = time.perf_counter()

        async def one(row: DatasetRow, at: float, tag: RequestTag) -> RequestOutput:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            h = {**(headers or {}), **tag.headers(tenant_header, priority_header)} or None
            if sem is None:
                out = await send_request(session, base_url, backend, row, model, start, headers=h,
                                         extra_body=tag.body())
            else:
                async with sem:
                    out = await send_request(session, base_url, backend, row, model, start, headers=h,
                                             extra_body=tag.body())
            bar.update(1)
            return out

        tags = tags or [RequestTag()] * len(rows)
        try:
            outputs = await asyncio.gather(*(one(r, t, g) for r, t, g in zip(rows, offsets, tags)))
        finally:
            bar.close()
        duration = time.perf_counter() - start
    return list(outputs), duration


def details(outputs: list[RequestOutput]) -> dict:
    """Per-request arrays (row order); None where a failed request has no such figure."""
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_len for o in outputs],
        "expected_output_lens": [o.expected_output_len for o in outputs],
        "ttfts": [o.ttft if o.success else None for o in outputs],
        "tpots": [o.tpot for o in outputs],
        "itls": [o.itl for o in outputs],
        "e2e_latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "errors": [o.error for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
    }


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "inf": the JSON line stays standard JSON
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def summary_line(r: dict) -> str:
    def ms(k):
        return "n/a" if r[k] is None else f"{r[k]:.1f}"

    return (f"bench_serving {r['backend']} {r['dataset_name']} rate={r['request_rate']}: "
            f"completed={r['completed']} failed={r['failed']} req/s={r['request_throughput']:.2f} "
            f"out_tok/s={r['output_throughput']:.1f} ttft_ms p50={ms('median_ttft_ms')} p99={ms('p99_ttft_ms')} "
            f"tpot_ms p50={ms('median_tpot_ms')} p99={ms('p99_tpot_ms')} goodput={r['goodput']:.2f} req/s")


def group_lines(groups: dict) -> list[str]:
    """One summary line per tenant and per priority."""
    def ms(v):
        return "n/a" if v is None else f"{v:.1f}"

    return [f"bench_serving {key.removeprefix('by_')}={name}: completed={g['completed']} failed={g['failed']} "
            f"ttft_ms p50={ms(g['median_ttft_ms'])} p99={ms(g['p99_ttft_ms'])} tpot_ms p50={ms(g['median_tpot_ms'])} "
            f"goodput={g['goodput']:.2f} req/s"
            for key in ("by_tenant", "by_priority") for name, g in groups.get(key, {}).items()]


def run_benchmark(args: argparse.Namespace, rows: list[DatasetRow] | None = None, tokenizer=None) -> dict:
    """Run one benchmark as the arguments say; return the arguments and every metric
    in one dict, plus the per-request arrays (``DETAIL_KEYS``) and ``error_counts``.

    ``rows`` replaces the dataset the arguments describe (the comparison script's
    own workloads); arrivals are Poisson at ``args.request_rate`` either way
    (call ``benchmark`` directly for other arrival times). Prints the table and summary line; writes the JSON
    line and plots when asked. Raises BenchmarkError when the run cannot happen.
    """
    if rows is None:
        tokenizer = tokenizer or load_tokenizer_for(args)
        rows = build_rows(args, tokenizer)
    backend = BACKENDS[args.backend]()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    base_url = args.base_url.rstrip("/")
    offsets = arrival_offsets(len(rows), args.request_rate, args.seed)
    tags = assign_tags(len(rows), args.tenants, args.tenant_weight_list, args.priority_mix_list, args.seed)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    outputs, duration = runner(benchmark(
        base_url, backend, rows, offsets, model=args.model, max_concurrency=args.max_concurrency,
        warmup_requests=args.warmup_requests, headers=headers, request_timeout=args.request_timeout,
        disable_tqdm=args.disable_tqdm, tags=tags, tenant_header=args.tenant_header_name,
        priority_header=args.priority_header,
    ))
    metrics = calculate_metrics(outputs, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    groups = group_metrics(outputs, tags, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    result = {**vars(args), "num_requests": len(rows), **metrics, **groups}
    if args.api_key:
        result["api_key"] = "***"  # results get shared; the key must not travel with them
    result["output_len_mismatches"] = sum(o.success and o.output_len != o.expected_output_len for o in outputs)
    result["error_counts"] = error_counts(outputs)

    print(format_table(result, [
        ("Backend:", args.backend),
        ("Base URL:", base_url),
        ("Dataset:", args.dataset_name),
        ("Traffic request rate:", args.request_rate),
        ("Max request concurrency:", args.max_concurrency or "not set"),
    ]))
    if groups:
        print(format_groups(groups))
    if result["error_counts"]:
        print(f"{result['failed']} request(s) failed:")
        for msg, n in list(result["error_counts"].items())[:10]:
            print(f"  {n} x {msg}")
    if result["output_len_mismatches"]:
        print(f"warning: {result['output_len_mismatches']} request(s) got another output length than asked")

    per_request = details(outputs)
    if args.output_file:
        line = {k: v for k, v in result.items()}
        if args.output_details:
            line.update(per_request)
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable(line), allow_nan=False) + "\n")
    result.update(per_request)
    if args.plot:
        from benchlib.plots import plot_run

        paths = plot_run(result, args.plot, label=f"{args.backend} {args.dataset_name}")
        print("plots: " + ", ".join(paths))
    print(summary_line(_jsonable(result)))
    for line in group_lines(groups):
        print(line)
    return result


def run_multi_turn(args: argparse.Namespace, convs=None, tokenizer=None) -> dict:
    """The multi-turn run: every turn of every conversation (``convs``: a ``multi_turn.Conversations``,
    else made from the arguments); prints a table by turn and one summary line; returns the figures."""
    from benchlib import multi_turn, server_metrics

    if convs is None:
        tokenizer = tokenizer or load_tokenizer_for(args)
        convs = multi_turn.make_conversations(
            tokenizer, args.mt_conversations, args.mt_turns, args.mt_message_len, args.mt_answer_len,
            args.random_range_ratio if args.random_range_ratio > 0 else 1.0, args.seed, args.dataset_path)
    base_url = args.base_url.rstrip("/")
    metrics_urls = [u.rstrip("/") for u in args.metrics_url] or [base_url]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    before = [server_metrics.scrape(u) for u in metrics_urls]
    records = asyncio.run(multi_turn.play_turns(
        base_url, convs, range(convs.num_turns), think_time=args.mt_think_time, headers=headers,
        request_timeout=args.request_timeout))
    servers = server_metrics.total([server_metrics.delta(server_metrics.scrape(u), b)
                                    for u, b in zip(metrics_urls, before)])
    result = {"dataset_name": "multi-turn", "source": convs.source, **multi_turn.summarize(records, args.mt_page_size)}
    prompt = servers["prompt_tokens"]
    result["servers"] = {
        **servers,
        "hit_rate": round(servers["cached_tokens"] / prompt, 3) if prompt else None,
        "hit_rate_by_tier": {
            "pool": round((servers["cached_tokens"] - servers["host_hit_tokens"] - servers["storage_hit_tokens"])
                          / prompt, 3) if prompt else None,
            "host": round(servers["host_hit_tokens"] / prompt, 3) if prompt else None,
            "storage": round(servers["storage_hit_tokens"] / prompt, 3) if prompt else None,
        },
    }
    print(f"{'turn':>4} {'p50 TTFT ms':>12} {'cached':>8} {'ideal':>8} {'prompt':>8}")
    for t, row in result["by_turn"].items():
        print(f"{t:>4} {row['p50_ttft_ms'] or 'n/a':>12} {row['cached']:>8} {row['ideal']:>8} {row['prompt']:>8}")
    s = result["servers"]
    print(f"bench_serving multi-turn ({convs.source}): {len(convs.messages)} conversations x {convs.num_turns} "
          f"turns, failed={result['failed']} hit rate {result['hit_rate']} of ideal (responses); servers: "
          f"cached/prompt {s['hit_rate']} (pool {s['hit_rate_by_tier']['pool']}, host "
          f"{s['hit_rate_by_tier']['host']}, storage {s['hit_rate_by_tier']['storage']}); prompt tokens computed "
          f"{result['computed_tokens']}; KV bytes sent {s['kv_sent_bytes']:.0f}")
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable({"args": vars(args), **result}), allow_nan=False) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dataset_name == "multi-turn":
        try:
            result = run_multi_turn(args)
        except (OSError, ValueError) as exc:
            print(f"bench_serving: error: {exc}", file=sys.stderr)
            return 1
        return 0 if result["failed"] == 0 else 1
    try:
        result = run_benchmark(args)
    except BenchmarkError as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 1
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
