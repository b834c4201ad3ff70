"""One frozen config for the ``pdserve planner`` process; the CLI takes every default from it and
``__post_init__`` names the field of a bad value."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.http_limits import HTTP_HEADER_TIMEOUT, MAX_CONNECTIONS, HttpLimits
from pdserve.entrypoints.planner.connector import CONNECTORS
from pdserve.entrypoints.planner.predictor import PREDICTORS


@dataclass(frozen=True)
class PlannerConfig:
    router: str = "http://127.0.0.1:8000"  # the router whose /metrics and /workers are read
    profile: str | None = None  # a profile for both roles, unless prefill_profile / decode_profile say otherwise
    prefill_profile: str | None = None
    decode_profile: str | None = None
    ttft_slo: float = 2.0  # seconds, met by slo_quantile of the requests
    itl_slo: float = 0.1
    slo_quantile: float = 0.95
    adjustment_interval: float = 15.0  # seconds between decisions
    predictor: str = "peak"
    predictor_window: int = 4  # intervals
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    cooldown: float = 60.0  # seconds a role waits after a change before it scales down
    budget: float = float("inf")  # the most cost (servers x TP size) both pools may take
    max_utilization: float = 0.85
    connector: str = "virtual"
    host: str = "127.0.0.1"  # the planner's own /metrics
    port: int = 0  # 0: a free port
    # the planner's own listener (engine/http_site.py): seconds to a whole request head, open
    # connections kept; its flags carry a planner- prefix, as the bare ones go to the servers
    http_header_timeout: float = HTTP_HEADER_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    api_key: str | None = None  # the router's --api-key
    # the router's --admin-api-key, for adding, draining and removing workers (default:
    # PDSERVE_ROUTER_ADMIN_API_KEY; a router without one takes those calls from loopback only)
    admin_api_key: str | None = None
    scrape_timeout: float = 5.0
    skip_profile_check: bool = False  # use the profiles even if the servers' configuration differs
    correction: bool = True  # off (--no-correction): plan by the profiles alone, the factors stay 1
    # local connector: how new servers start (flags of `pdserve serve`, the transfer backend)
    serve_args: tuple[str, ...] = ()
    transfer_backend: str = "mooncake"
    log_dir: str | None = None
    startup_timeout: float = 600.0
    drain_timeout: float = 300.0  # seconds a draining server gets to finish its requests
    leave_servers: bool = False  # at exit, leave the servers the planner started running
    # kubernetes connector: deploy/k8s's names
    namespace: str = "pdserve"
    prefill_statefulset: str = "pdserve-prefill"
    decode_statefulset: str = "pdserve-decode"
    router_pods: str = "http://pdserve-router-pods:30000"  # every router replica (headless Service)

    def __post_init__(self):
        if self.connector not in CONNECTORS:
            raise ValueError(f"connector must be one of {list(CONNECTORS)}, got {self.connector!r}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {PREDICTORS}, got {self.predictor!r}")
        if not (self.profile or (self.prefill_profile and self.decode_profile)):
            raise ValueError("profile: give --profile, or --prefill-profile and --decode-profile")
        if not self.router.startswith(("http://", "https://")):
            raise ValueError(f"router must be an http(s) URL, got {self.router!r}")
        for name in ("ttft_slo", "itl_slo", "adjustment_interval", "scrape_timeout", "startup_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not 0 <= lo <= hi:
                raise ValueError(f"min_{role} / max_{role}: need 0 <= min <= max, got {lo} and {hi}")
        if self.cooldown < 0 or not self.budget > 0:
            raise ValueError(f"cooldown must be >= 0 and budget > 0, got {self.cooldown} and {self.budget}")
        if self.predictor_window < 1:
            raise ValueError(f"predictor_window must be >= 1, got {self.predictor_window}")
        if self.serve_args and self.connector != "local":
            raise ValueError(f"serve flags {list(self.serve_args)} are for the servers the local connector starts; "
                             f"the {self.connector} connector starts none")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        HttpLimits(self.http_header_timeout, self.max_connections)  # raises on a bad one

    @property
    def http_limits(self) -> HttpLimits:
        """The limits of the planner's listener."""
        return HttpLimits(self.http_header_timeout, self.max_connections)

    @property
    def prefill_profile_path(self) -> str:
        return self.prefill_profile or self.profile

    @property
    def decode_profile_path(self) -> str:
        return self.decode_profile or self.profile
