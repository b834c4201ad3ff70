"""``pdserve router`` / ``python -m pdserve.router``: flags named as sglang-router names them,
every default taken from ``RouterConfig``."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

from pdserve.engine.tracing import TRACE_FLAG_HELP
from pdserve.router.auth import keys_from_flags
from pdserve.router.config import DP_RANK_POLICIES, LOG_LEVELS, RouterConfig, WorkerSpec
from pdserve.router.policy import POLICY_NAMES
from pdserve.router.tenancy.slo import SLO_MISS_POLICIES

_D = {f.name: f.default for f in fields(RouterConfig)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="pdserve router",
                                description="PD router: pairs each request with a prefill and a "
                                            "decode worker (SGLang PD protocol).")
    p.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                   help="prefill server URL and optional bootstrap port (a number or 'none'); repeatable")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="decode server URL; repeatable")
    p.add_argument("--pd-disaggregation", action="store_true",
                   help="accepted for sglang-router compatibility (this router is always PD)")
    p.add_argument("--host", default=_D["host"])
    p.add_argument("--port", type=int, default=_D["port"])
    p.add_argument("--policy", choices=POLICY_NAMES, default=_D["policy"])
    p.add_argument("--prefill-policy", choices=POLICY_NAMES, default=_D["prefill_policy"])
    p.add_argument("--decode-policy", choices=POLICY_NAMES, default=_D["decode_policy"])
    p.add_argument("--cache-threshold", type=float, default=_D["cache_threshold"])
    p.add_argument("--balance-abs-threshold", type=int, default=_D["balance_abs_threshold"])
    p.add_argument("--balance-rel-threshold", type=float, default=_D["balance_rel_threshold"])
    p.add_argument("--max-tree-size", type=int, default=_D["max_tree_size"])
    p.add_argument("--dp-aware", action="store_true", default=_D["dp_aware"])
    p.add_argument("--dp-rank-policy", choices=DP_RANK_POLICIES, default=_D["dp_rank_policy"],
                   help="which DP rank of a worker gets a request: the fewest tokens in flight, or each in turn")
    p.add_argument("--dp-minimum-tokens-scheduler", action="store_true",
                   help="accepted for sglang-router compatibility: --dp-rank-policy least_tokens (the default)")
    p.add_argument("--kv-overlap-score-weight", type=float, default=_D["kv_overlap_score_weight"])
    p.add_argument("--kv-events-timeout-secs", type=float, default=_D["kv_events_timeout_secs"])
    p.add_argument("--kv-host-cache-hit-weight", type=float, default=_D["kv_host_cache_hit_weight"],
                   help="kv_aware: a block in a worker's host memory against one in its KV pool (1.0)")
    p.add_argument("--kv-storage-cache-hit-weight", type=float, default=_D["kv_storage_cache_hit_weight"],
                   help="kv_aware: a block in the store shared by every worker against one in a KV pool (1.0)")
    p.add_argument("--tokenizer-path", default=_D["tokenizer_path"],
                   help="the workers' tokenizer (kv_aware, --local-prefill-max-tokens); default: the tokenizer_path "
                        "or model_path of a worker's /server_info")
    p.add_argument("--local-prefill-max-tokens", type=int, default=_D["local_prefill_max_tokens"],
                   help="prompts of up to this many tokens (kv_aware: uncached on the decode worker) are "
                   "prefilled by the decode worker, under any prefill policy; decode workers need "
                   "--max-local-prefill-tokens (0: off)")
    p.add_argument("--prefill-queue-threshold", type=int, default=_D["prefill_queue_threshold"],
                   help="also prefill on the decode worker when every prefill worker has more than this "
                   "many requests in flight (0: off)")
    p.add_argument("--api-key", default=_D["api_key"],
                   help="key of the inference routes ('Authorization: Bearer KEY'); it shows in the process "
                        "list: prefer --api-key-file or PDSERVE_ROUTER_API_KEY")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="file holding --api-key")
    p.add_argument("--admin-api-key", default=_D["admin_api_key"],
                   help="key of the admin routes (/workers add, remove, drain; control fan-outs); without "
                        "one they answer loopback peers only; prefer --admin-api-key-file or "
                        "PDSERVE_ROUTER_ADMIN_API_KEY")
    p.add_argument("--admin-api-key-file", default=None, metavar="PATH", help="file holding --admin-api-key")
    p.add_argument("--max-concurrent-requests", type=int, default=_D["max_concurrent_requests"])
    p.add_argument("--queue-size", type=int, default=_D["queue_size"])
    p.add_argument("--queue-timeout-secs", type=float, default=_D["queue_timeout_secs"])
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="order the queue by the x-pdserve-priority header (larger first), then arrival; "
                        "a full queue gives way to a higher priority")
    p.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling, smaller priority values go first")
    p.add_argument("--request-timeout-secs", type=float, default=_D["request_timeout_secs"])
    p.add_argument("--max-payload-size", type=int, default=_D["max_payload_size"],
                   help="largest request body in bytes (default: the engine servers' limit); larger: 413")
    p.add_argument("--max-response-bytes", type=int, default=_D["max_response_bytes"],
                   help="largest non-streamed worker answer relayed, in bytes; larger: 502")
    p.add_argument("--http-header-timeout", type=float, default=_D["http_header_timeout"],
                   help="seconds a connection may go without a whole request head, from its start and from "
                        "each answer (a slow or idle client), before it is closed")
    p.add_argument("--http-read-timeout", type=float, default=_D["http_read_timeout"],
                   help="seconds a client may take to send a request body; slower: 408")
    p.add_argument("--max-connections", type=int, default=_D["max_connections"],
                   help="open client connections kept at once; more are answered 503 and closed")
    p.add_argument("--retry-max-retries", type=int, default=_D["retry_max_retries"],
                   help="attempts in total, as in sglang-router (1: no retry)")
    p.add_argument("--retry-initial-backoff-ms", type=float, default=_D["retry_initial_backoff_ms"])
    p.add_argument("--retry-max-backoff-ms", type=float, default=_D["retry_max_backoff_ms"])
    p.add_argument("--retry-backoff-multiplier", type=float, default=_D["retry_backoff_multiplier"])
    p.add_argument("--retry-jitter-factor", type=float, default=_D["retry_jitter_factor"])
    p.add_argument("--migration-limit", type=int, default=_D["migration_limit"],
                   help="times a streamed /generate whose decode worker failed mid-stream is continued "
                   "on another prefill/decode pair, prompt plus the tokens sent (0: off)")
    p.add_argument("--disable-retries", action="store_true", help="same as --retry-max-retries 1")
    p.add_argument("--health-check-interval-secs", type=float, default=_D["health_check_interval_secs"])
    p.add_argument("--health-check-timeout-secs", type=float, default=_D["health_check_timeout_secs"])
    p.add_argument("--health-failure-threshold", type=int, default=_D["health_failure_threshold"])
    p.add_argument("--health-success-threshold", type=int, default=_D["health_success_threshold"])
    p.add_argument("--worker-startup-timeout-secs", type=float, default=_D["worker_startup_timeout_secs"],
                   help="how long a worker that was added or failed is probed often (every 0.5 s "
                        "while it was never healthy; from 0.5 s backing off to "
                        "--health-check-interval-secs once it was) before it is only probed every interval")
    p.add_argument("--request-queue-timeout-secs", type=float, default=_D["request_queue_timeout_secs"],
                   help="how long a request waits for a healthy prefill+decode pair before a 503 "
                        "(0: answer 503 at once)")
    p.add_argument("--graceful-shutdown-timeout", "--shutdown-grace-period-secs", type=float,
                   dest="graceful_shutdown_timeout", default=_D["graceful_shutdown_timeout"],
                   help="on SIGTERM, how long in-flight requests may take to finish (SGLang's "
                        "flag; sglang-router's name is accepted too)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default=_D["log_level"])
    p.add_argument("--enable-trace", action="store_true", default=_D["enable_trace"],
                   help=TRACE_FLAG_HELP["enable_trace"])
    p.add_argument("--otlp-traces-endpoint", default=_D["otlp_traces_endpoint"],
                   help=TRACE_FLAG_HELP["otlp_traces_endpoint"])
    p.add_argument("--trace-sample-ratio", type=float, default=_D["trace_sample_ratio"],
                   help=TRACE_FLAG_HELP["trace_sample_ratio"])
    p.add_argument("--lora-paths", nargs="+", default=list(_D["lora_paths"]), metavar="NAME=PATH",
                   help="LoRA adapters the router may load on a worker that lacks one a request names "
                        "(paths as the workers read them); the workers' /v1/models paths serve too")
    p.add_argument("--lora-load-on-demand", action=argparse.BooleanOptionalAction,
                   default=_D["lora_load_on_demand"],
                   help="load a request's adapter on the chosen worker when no worker holds it")
    p.add_argument("--tenant-config", default=_D["tenant_config"], metavar="FILE",
                   help="tenants' weights, rate limits (requests_per_second, tokens_per_second), "
                        "max_concurrent and api_keys, JSON or YAML; the queue is shared fairly between them")
    p.add_argument("--tenant-header", default=_D["tenant_header"], metavar="NAME",
                   help="header naming a request's tenant when its API key names none (default: one tenant)")
    p.add_argument("--slo-ttft-ms", type=float, default=_D["slo_ttft_ms"],
                   help="default TTFT target in ms (x-pdserve-ttft-slo-ms sets one per request); a request "
                        "whose estimated TTFT misses it gets --slo-miss-policy (0: off)")
    p.add_argument("--slo-miss-policy", choices=SLO_MISS_POLICIES, default=_D["slo_miss_policy"],
                   help="reject: 503 with the reason at once; deprioritize: queued after every other request")
    return p


def parse_prefill(values: list[str]) -> WorkerSpec:
    if len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {values}")
    port = None
    if len(values) == 2 and values[1].lower() != "none":
        port = int(values[1])
    return WorkerSpec(values[0], "prefill", port)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    names = RouterConfig.field_names() - {"prefill", "decode"}
    kwargs = {name: getattr(args, name) for name in names}
    if args.disable_retries:
        kwargs["retry_max_retries"] = 1
    kwargs["lora_paths"] = tuple(args.lora_paths)
    if args.dp_minimum_tokens_scheduler and args.dp_rank_policy != "least_tokens":
        raise ValueError("--dp-minimum-tokens-scheduler is --dp-rank-policy least_tokens; "
                         f"it contradicts --dp-rank-policy {args.dp_rank_policy}")
    kwargs["api_key"], kwargs["admin_api_key"] = keys_from_flags(
        args.api_key, args.api_key_file, args.admin_api_key, args.admin_api_key_file)
    return RouterConfig(prefill=tuple(parse_prefill(v) for v in args.prefill),
                        decode=tuple(WorkerSpec(u, "decode") for u in args.decode), **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    level = "warning" if config.log_level == "warn" else config.log_level
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.router.server import serve

    serve(config)


if __name__ == "__main__":
    main()
