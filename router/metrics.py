"""Prometheus metrics of the router (``GET /metrics``).

The request path counts into labelled counters and histograms kept as plain
numbers (router/metric_cells.py: ``prometheus_client``'s own cost a lock and a
check per update, on the router's busiest path); the per-worker gauges (in
flight, healthy) are read from the ``WorkerRegistry`` when scraped.
Each ``RouterMetrics`` has its own ``CollectorRegistry`` (never the library's
global one), so routers and tests in one process do not share counts.

The labelled counters start with a 0 sample for every label value known in
advance (the retry causes, the prefill modes, the local-prefill reasons, the
inference routes answered 200): a dashboard panel reads 0 on a healthy cluster,
not "no data" until the first event.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.engine.prometheus_text import exposition
from pdserve.router.local_prefill import LocalReason
from pdserve.router.metric_cells import CounterCells, HistogramCells
from pdserve.router.policy import Policy
from pdserve.router.workers.worker_registry import WorkerRegistry

LEGS = ("prefill", "decode")
# the causes of a retry known in advance (upstream.UpstreamError's and pd_proxy's); http_<status> is
# counted when it happens
RETRY_CAUSES = ("connect", "timeout", "connection_lost", "malformed", "empty_stream", "error_in_answer")
PREFILL_MODES = ("remote", "local", "local_refused")
LOCAL_REASONS = tuple(r.value for r in LocalReason)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, policies: dict[str, Policy] | None = None,
                 routes: tuple[str, ...] = ()):
        """``policies``: role -> the role's policy, whose ``counts()`` are scraped; ``routes``: the
        inference routes, whose requests_total{status="200"} is exported from the start."""
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = CounterCells("pdserve_router_requests_total",
                                     "Client requests by route and HTTP status.", ("route", "status"), reg)
        self.leg_requests = CounterCells("pdserve_router_worker_requests_total",
                                         "Requests sent to a worker, by leg.", ("worker", "leg"), reg)
        self.leg_errors = CounterCells("pdserve_router_worker_errors_total", "Failed legs, by worker and leg.",
                                       ("worker", "leg"), reg)
        self.leg_retries = CounterCells("pdserve_router_worker_retries_total",
                                        "Retries caused by a failed leg, by the worker and leg that failed.",
                                        ("worker", "leg"), reg)
        self.prefills = CounterCells("pdserve_router_prefills_total",
                                     "Prefills by where they ran: remote (a prefill worker), local "
                                     "(the decode worker), local_refused (sent back to remote).",
                                     ("mode",), reg)
        self.local_reasons = CounterCells("pdserve_router_local_prefill_decisions_total",
                                          "Requests sent to a decode worker alone, by why: short "
                                          "(uncached part within --local-prefill-max-tokens), queue "
                                          "(every prefill queue above --prefill-queue-threshold).",
                                          ("reason",), reg)
        self.retries = Counter("pdserve_router_retries_total", "Retries of client requests on a new pair.",
                               registry=reg)
        self.retries_by_cause = CounterCells(
            "pdserve_router_retries_by_cause_total",
            "Retries of client requests, by the leg that failed and why: connect, timeout, connection_lost, "
            "malformed, empty_stream, error_in_answer (a 200 carrying an error: on a prefill leg, its KV "
            "room failed), http_<status>.", ("leg", "cause"), reg)
        self.migrations = CounterCells(
            "pdserve_router_migrations_total",
            "Streams continued on another pair after their decode leg failed mid-stream (--migration-limit), "
            "by why it failed (connection_lost, timeout, eof, error_event) and outcome (migrated; "
            "limit, no_pair, failed: the stream ended with an error).", ("cause", "outcome"), reg)
        leg_latency = HistogramCells("pdserve_router_leg_latency_seconds",
                                     "Latency of a leg that succeeded, from its request to its whole answer "
                                     "(a streamed decode leg: to the stream's end).", LATENCY_BUCKETS, reg,
                                     labels=("leg",))
        self.leg_latency = {leg: leg_latency.child(leg) for leg in LEGS}
        self.ttft = HistogramCells("pdserve_router_ttft_seconds", "Time to the first byte sent to the client.",
                                   LATENCY_BUCKETS, reg).child()
        self.e2e = HistogramCells("pdserve_router_e2e_seconds", "End-to-end request latency at the router.",
                                  LATENCY_BUCKETS, reg).child()
        for route in routes:
            self.requests.touch(route, "200")
        for leg in LEGS:
            for cause in RETRY_CAUSES:
                self.retries_by_cause.touch(leg, cause)
        for mode in PREFILL_MODES:
            self.prefills.touch(mode)
        for reason in LOCAL_REASONS:
            self.local_reasons.touch(reason)
        reg.register(_WorkerGauges(workers))
        reg.register(_PolicyCounts(policies or {}))

    def render(self) -> bytes:
        """The text exposition format of every metric (labels in declared order)."""
        return exposition(self.registry)


class _WorkerGauges:
    """A collector of the workers' gauges: the registry's own figures, read at scrape time."""

    def __init__(self, workers: WorkerRegistry):
        self.workers = workers

    def collect(self):
        labels = ("worker", "role")
        in_flight = GaugeMetricFamily("pdserve_router_worker_in_flight", "Requests in flight on a worker.",
                                      labels=labels)
        healthy = GaugeMetricFamily("pdserve_router_worker_healthy", "1 when the worker is in rotation.",
                                    labels=labels)
        for w in self.workers.workers():
            in_flight.add_metric((w.url, w.role), w.load)
            healthy.add_metric((w.url, w.role), int(w.healthy))
        yield in_flight
        yield healthy


class _PolicyCounts:
    """The policies' own counts (``Policy.counts``), read at scrape time."""

    def __init__(self, policies: dict[str, Policy]):
        self.policies = policies

    def collect(self):
        family = CounterMetricFamily("pdserve_router_policy_events",
                                     "Routing policy events (kv_aware: kv_routed, fallback, and KV event "
                                     "stream faults: malformed, gaps, replays, dropped, stale, restarts, silent).",
                                     labels=("role", "event"))
        for role, policy in self.policies.items():
            for event, n in sorted(policy.counts().items()):
                family.add_metric((role, event), n)
        yield family
