"""One frozen config for the router process.

The CLI (``pdserve router`` / ``python -m pdserve.router``) takes every default
from these fields, and the field names follow sglang-router's flags
(``--retry-max-retries`` -> ``retry_max_retries``), so an operator can move a
command line between the two. ``__post_init__`` validates, so a bad value
fails at start with a message naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from pdserve.engine.tracing import DEFAULT_ENDPOINT, TraceConfig
from pdserve.engine.lora_names import parse_lora_paths
from pdserve.engine.http_limits import (HTTP_HEADER_TIMEOUT, HTTP_READ_TIMEOUT, MAX_CONNECTIONS, MAX_REQUEST_BYTES,
                                        HttpLimits)
from pdserve.router.policy import POLICY_NAMES
from pdserve.router.tenancy.slo import MAX_SLO_MS, SLO_MISS_POLICIES
from pdserve.router.tenancy.tenant_config import TenantTable, load_tenant_table

LOG_LEVELS = ("debug", "info", "warn", "warning", "error")
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")
# --dp-rank-policy: how a worker's DP rank is chosen (router/workers/dp_rank_choice.py)
DP_RANK_POLICIES = ("least_tokens", "round_robin")


@dataclass(frozen=True)
class WorkerSpec:
    """A worker as given on the command line or to ``POST /workers``."""

    url: str
    role: str  # "prefill" | "decode"
    bootstrap_port: int | None = None  # prefill only; None: the server has no bootstrap port

    def __post_init__(self):
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"worker url must start with http:// or https://, got {self.url!r}")
        if self.bootstrap_port is not None and not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port must be in 1..65535, got {self.bootstrap_port}")


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    host: str = "0.0.0.0"
    port: int = 30000
    # policies; prefill_policy/decode_policy None: use `policy`
    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26  # characters per worker in the approximate prefix tree
    dp_aware: bool = False
    # which DP rank of a worker gets a request (router/workers/dp_rank_choice.py): the fewest
    # tokens in flight, or each in turn
    dp_rank_policy: str = "least_tokens"
    # kv_aware (router/kv/kv_aware_policy.py): Dynamo's --kv-overlap-score-weight; seconds without
    # events (and no replay answer) before a worker's blocks leave the index; tokenizer of the
    # workers' model (None: their /server_info model_path, else the default model)
    kv_overlap_score_weight: float = 1.0
    kv_events_timeout_secs: float = 60.0
    # kv_aware's tiers (router/kv/kv_tiers.py): what a block in a worker's host memory, and one in
    # the store every worker reads, saves against computing it (a pool block saves 1); Dynamo's
    # --router-host-cache-hit-weight and --router-disk-cache-hit-weight (docs/ROUTER.md: why)
    kv_host_cache_hit_weight: float = 0.8
    kv_storage_cache_hit_weight: float = 0.5
    tokenizer_path: str | None = None
    # conditional disaggregation: a prompt of at most this many tokens (kv_aware: uncached on the
    # decode worker) goes to a decode worker alone, which prefills it itself, under any prefill
    # policy (router/prompt_tokenizer.py counts it where the policy does not tokenize) and only to
    # a decode worker whose own --max-local-prefill-tokens admits it; 0: never
    local_prefill_max_tokens: int = 0
    # ... and any request when every prefill endpoint has more than this many requests in flight
    # and the decode endpoint fewer local prefills (router/local_prefill.py); 0: never
    prefill_queue_threshold: int = 0
    # security and limits (router/auth.py): the inference key and the admin key (None: admin
    # routes answer loopback peers only); the CLI also reads them from files or the environment
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    max_concurrent_requests: int = -1  # -1: unlimited
    queue_size: int = 100  # 0: no queue, answer 429 at once
    queue_timeout_secs: float = 60.0
    # the queue's order (router/admission.py): the x-pdserve-priority header, SGLang's meaning
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    request_timeout_secs: float = 1800.0
    # the largest request body read (the engine servers' own limit: a larger one they would
    # refuse) and the largest non-streamed answer of a worker relayed (over it: 502)
    max_payload_size: int = MAX_REQUEST_BYTES
    max_response_bytes: int = 64 * 1024 * 1024
    # slow clients (engine/http_site.py): seconds to a whole request head (from the connection's
    # start and each answer; idle keep-alive too) and to a whole body (else 408); the open
    # connections kept (more are answered 503)
    http_header_timeout: float = HTTP_HEADER_TIMEOUT
    http_read_timeout: float = HTTP_READ_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    # retries: retry_max_retries counts attempts in total, as sglang-router does (1 = no retry)
    retry_max_retries: int = 5
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 30000.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    # request migration (router/migration/migration.py, Dynamo's --migration-limit): how many times a
    # streamed /generate whose decode leg failed after the first byte is continued on another
    # pair; 0: never (the stream ends with an error event)
    migration_limit: int = 0
    # health
    health_check_interval_secs: float = 60.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 1
    # start order and shutdown (router/workers/readiness.py, router/workers/drain.py): a worker that was never
    # healthy is probed every 0.5 s, one that was healthy and failed from 0.5 s with backoff up to
    # health_check_interval_secs, for at most worker_startup_timeout_secs (sglang-router's
    # default); a request that finds no healthy pair
    # waits request_queue_timeout_secs for one; SIGTERM finishes in-flight requests within
    # graceful_shutdown_timeout (sglang-router's --shutdown-grace-period-secs default)
    worker_startup_timeout_secs: float = 1800.0
    request_queue_timeout_secs: float = 30.0
    graceful_shutdown_timeout: float = 180.0
    log_level: str = "info"
    # OpenTelemetry traces (SGLang's flags; engine/tracing.py): off by default, OTLP/HTTP protobuf
    enable_trace: bool = False
    otlp_traces_endpoint: str = DEFAULT_ENDPOINT
    trace_sample_ratio: float = 1.0
    # LoRA adapters (router/workers/adapters.py): where each adapter is read from (SGLang's
    # NAME=PATH entries), for loading one on a worker that lacks it when the workers' /v1/models
    # do not list its path; lora_load_on_demand: a request whose adapter no worker holds has it
    # loaded on the worker its policy chose (off: it goes there as it is)
    lora_paths: tuple[str, ...] = ()
    lora_load_on_demand: bool = True
    # tenants (router/admission_fair.py, router/tenancy/): the file of weights, limits and keys, and
    # the header naming a request's tenant (None: every request without a tenant key is 'default');
    # SLO admission: the default TTFT target in ms (0: off; x-pdserve-ttft-slo-ms sets one per
    # request) and what a request whose estimate misses it gets (503 at once, or the last place)
    tenant_config: str | None = None
    tenant_header: str | None = None
    slo_ttft_ms: float = 0.0
    slo_miss_policy: str = "reject"

    @property
    def http_limits(self) -> HttpLimits:
        """The limits of the router's listener."""
        return HttpLimits(self.http_header_timeout, self.max_connections)

    @property
    def trace(self) -> TraceConfig:
        """What the tracing flags say (``make_tracer`` takes it)."""
        return TraceConfig(self.enable_trace, self.otlp_traces_endpoint, self.trace_sample_ratio)

    def __post_init__(self):
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            if value is not None and value not in POLICY_NAMES:
                raise ValueError(f"{name} must be one of {POLICY_NAMES}, got {value!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.schedule_low_priority_values_first and not self.enable_priority_scheduling:
            raise ValueError("schedule_low_priority_values_first orders priorities: it needs "
                             "enable_priority_scheduling")
        if self.max_concurrent_requests == 0 or self.max_concurrent_requests < -1:
            raise ValueError("max_concurrent_requests must be -1 (unlimited) or >= 1")
        for name in ("queue_size", "balance_abs_threshold", "local_prefill_max_tokens",
                     "prefill_queue_threshold", "migration_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("retry_max_retries", "health_failure_threshold", "health_success_threshold",
                     "max_tree_size", "max_payload_size", "max_response_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("queue_timeout_secs", "request_timeout_secs", "health_check_interval_secs",
                     "health_check_timeout_secs", "worker_startup_timeout_secs", "kv_events_timeout_secs",
                     "http_read_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("request_queue_timeout_secs", "graceful_shutdown_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        HttpLimits(self.http_header_timeout, self.max_connections)  # raises on a bad one
        if self.kv_overlap_score_weight < 0:
            raise ValueError(f"kv_overlap_score_weight must be >= 0, got {self.kv_overlap_score_weight}")
        for name in ("kv_host_cache_hit_weight", "kv_storage_cache_hit_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:  # a lower tier saves at most what the pool does
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if not 0.0 <= self.retry_jitter_factor <= 1.0:
            raise ValueError(f"retry_jitter_factor must be in [0, 1], got {self.retry_jitter_factor}")
        if self.retry_backoff_multiplier < 1.0:
            raise ValueError("retry_backoff_multiplier must be >= 1")
        self.trace  # raises on a bad --trace-sample-ratio or --otlp-traces-endpoint
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        parse_lora_paths(self.lora_paths)  # raises naming lora_paths
        self._check_tenancy()
        for spec in self.prefill:
            if spec.role != "prefill":
                raise ValueError(f"{spec.url} given as prefill has role {spec.role!r}")
        for spec in self.decode:
            if spec.role != "decode":
                raise ValueError(f"{spec.url} given as decode has role {spec.role!r}")
        if self.dp_rank_policy not in DP_RANK_POLICIES:
            raise ValueError(f"dp_rank_policy must be one of {DP_RANK_POLICIES}, got {self.dp_rank_policy!r}")

    def _check_tenancy(self) -> None:
        if self.slo_miss_policy not in SLO_MISS_POLICIES:
            raise ValueError(f"slo_miss_policy must be one of {SLO_MISS_POLICIES}, got {self.slo_miss_policy!r}")
        if not 0 <= self.slo_ttft_ms <= MAX_SLO_MS:  # also refuses nan
            raise ValueError(f"slo_ttft_ms must be in [0, {MAX_SLO_MS:.0f}], got {self.slo_ttft_ms}")
        if self.tenant_header is not None and (not HEADER_NAME.fullmatch(self.tenant_header)
                                               or self.tenant_header.lower() == "authorization"):
            raise ValueError(f"tenant_header must be an HTTP header name other than Authorization, "
                             f"got {self.tenant_header!r}")
        self.tenant_table  # raises naming the file, the tenant and the field

    @property
    def tenant_table(self) -> TenantTable:
        """The tenants of ``--tenant-config`` (every tenant alike without one)."""
        return load_tenant_table(self.tenant_config)

    @property
    def tenancy(self) -> bool:
        """Whether requests queue by tenant (router/admission_fair.py) rather than in one queue."""
        return bool(self.tenant_config or self.tenant_header or self.slo_ttft_ms)

    @property
    def effective_prefill_policy(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def effective_decode_policy(self) -> str:
        return self.decode_policy or self.policy

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def backoff_ms(config: RouterConfig, attempt: int, rand: float) -> float:
    """Delay before retry number ``attempt`` (1 = first retry); ``rand`` in [0, 1) gives the jitter."""
    base = min(config.retry_initial_backoff_ms * config.retry_backoff_multiplier ** (attempt - 1),
               config.retry_max_backoff_ms)
    return base * (1.0 + config.retry_jitter_factor * (2.0 * rand - 1.0))
