"""Prometheus metrics of the engine server (``GET /metrics``), kept by ``prometheus-client``.

Counters and histograms are updated by the tokenizer manager as requests move;
per-rank gauges (running, waiting, KV usage, in flight, the PD queues, quarantined
pages) are read from the ranks' latest ``SchedulerStats`` when scraped, and each
scheduler process's own families (its KV rooms: ``kvtransfer/room_metrics.py``; a MoE
model's all-to-all counters and expert load) from its latest ``RankMetrics``, with ``dp_rank``
and ``tp_rank`` labels added, and the expert load imbalance derived from them
(``expert_metrics.py``).
Names and their SGLang counterparts: docs/ARCHITECTURE.md, "Metrics and the request
log". Each ``ServerMetrics`` has its own ``CollectorRegistry`` (never the library's
global one), so servers and tests in one process do not share counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.engine.frontend.expert_metrics import imbalance_family
from pdserve.engine.prometheus_text import exposition
from pdserve.engine.messages import RankMetrics, SchedulerStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, dp_size: int, model_name: str, experts_span_dp: bool = False):
        """``experts_span_dp``: the MoE experts are spread over every DP rank (DP attention)."""
        self.dp_size = dp_size
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("pdserve_requests_total", "Sequences dispatched, per DP rank.",
                                ("model_name", "dp_rank"), registry=reg)
        self.finished = Counter("pdserve_requests_finished_total", "Sequences finished, per finish reason.",
                                ("model_name", "reason"), registry=reg)
        self.http_requests = Counter("pdserve_http_requests_total", "HTTP requests, per path and status.",
                                     ("path", "status"), registry=reg)
        self.prompt_tokens = Counter("pdserve_prompt_tokens_total", "Prompt tokens of finished sequences.",
                                     ("model_name",), registry=reg).labels(model_name)
        self.generation_tokens = Counter("pdserve_generation_tokens_total",
                                         "Generated tokens of finished sequences.",
                                         ("model_name",), registry=reg).labels(model_name)
        self.cached_tokens = Counter("pdserve_cached_tokens_total", "Prompt tokens served from the prefix cache.",
                                     ("model_name",), registry=reg).labels(model_name)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=E2E_BUCKETS, registry=reg)
        # a bootstrap PUT /route refused by authentication (prefill servers); the ranks' own
        # refusals of control frames come with their stats (pdserve_kv_auth_refused_total)
        self.bootstrap_auth_refused = Counter("pdserve_bootstrap_auth_refused_total",
                                              "Bootstrap registrations refused by KV control-plane authentication.",
                                              registry=reg)
        self._by_rank = [self.requests.labels(model_name, str(r)) for r in range(dp_size)]
        self._gauges = _RankGauges(model_name, dp_size)
        reg.register(self._gauges)
        self._rank_families = _RankFamilies(model_name, experts_span_dp)
        reg.register(self._rank_families)

    def on_dispatch(self, dp_rank: int) -> None:
        self._by_rank[dp_rank].inc()

    def on_http(self, path: str, status: int) -> None:
        self.http_requests.labels(path, str(status)).inc()

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int, cached: int, e2e: float) -> None:
        self.finished.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached)
        self.e2e.observe(e2e)

    def render(self, stats: list[SchedulerStats | None], inflight: list[int],
               rank_metrics: dict[tuple[int, int], RankMetrics] | None = None) -> str:
        """The text exposition of every metric (labels in declared order), the gauges from ``stats``
        and ``inflight`` (per DP rank), and the scheduler processes' own ``rank_metrics`` (per
        (DP rank, TP rank))."""
        self._gauges.stats, self._gauges.inflight = stats, inflight
        self._rank_families.latest = rank_metrics or {}
        return exposition(self.registry).decode()


class _RankGauges:
    """A collector of the per-rank gauges: they are the ranks' own figures, read at scrape time."""

    def __init__(self, model_name: str, dp_size: int):
        self.model_name = model_name
        self.stats: list[SchedulerStats | None] = [None] * dp_size
        self.inflight = [0] * dp_size

    def collect(self):
        labels = ("model_name", "dp_rank")
        ranks = [(str(r), s) for r, s in enumerate(self.stats) if s is not None]

        def per_rank(name: str, help_: str, value) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, help_, labels=labels)
            for rank, s in ranks:
                g.add_metric((self.model_name, rank), value(s))
            return g

        yield per_rank("pdserve_num_running_reqs", "Running requests per DP rank.", lambda s: s.num_running)
        yield per_rank("pdserve_num_waiting_reqs", "Waiting requests per DP rank.", lambda s: s.num_waiting)
        yield per_rank("pdserve_num_running_tokens", "Tokens of the running requests per DP rank.",
                       lambda s: s.num_running_tokens)
        yield per_rank("pdserve_num_queued_tokens", "Tokens of the waiting requests per DP rank.",
                       lambda s: s.num_queued_tokens)
        inflight = GaugeMetricFamily("pdserve_inflight_requests",
                                     "Sequences the HTTP process has in flight per DP rank.", labels=labels)
        for r, n in enumerate(self.inflight):
            inflight.add_metric((self.model_name, str(r)), n)
        yield inflight
        yield per_rank("pdserve_kv_free_pages", "Free KV pages per DP rank.", lambda s: s.num_free_pages)
        yield per_rank("pdserve_kv_total_pages", "KV pages per DP rank.", lambda s: s.num_total_pages)
        refused = CounterMetricFamily("pdserve_kv_auth_refused",
                                      "KV control frames refused by authentication per DP rank.", labels=labels)
        for rank, s in ranks:
            refused.add_metric((self.model_name, rank), s.kv_auth_refused)
        yield refused
        yield per_rank("pdserve_kv_usage", "Fraction of KV pages in use per DP rank.",
                       lambda s: round(1.0 - s.num_free_pages / max(s.num_total_pages, 1), 6))
        # the PD queues under SGLang's names (sglang:num_... -> pdserve_num_...); each is 0 on a
        # server of the other mode. The TP ranks of a DP rank hold the same queues: no tp_rank label
        for name, help_ in _PD_QUEUES:
            yield per_rank(f"pdserve_{name}", help_, lambda s, n=name: getattr(s, n))
        yield per_rank("pdserve_kv_quarantine_pages", "Decode: pages of failed rooms held until their prefill "
                       "closed the room (or quarantine_timeout) per DP rank.", lambda s: s.num_quarantine_pages)


_PD_QUEUES = (
    ("num_prefill_prealloc_queue_reqs", "Prefill: requests in the bootstrap queue (waiting for their decode "
                                        "destination; SGLang's prefill prealloc queue) per DP rank."),
    ("num_prefill_inflight_queue_reqs", "Prefill: requests whose last chunk is computed, waiting for their KV "
                                        "to be written, per DP rank."),
    ("num_decode_prealloc_queue_reqs", "Decode: requests waiting for their prefill rank and for pages per DP rank."),
    ("num_decode_transfer_queue_reqs", "Decode: requests holding pages while their KV arrives per DP rank."),
)


class _RankFamilies:
    """A collector of the scheduler processes' own families (``RankMetrics``), merged by name,
    each sample labelled with the model and the (DP, TP) rank it came from."""

    def __init__(self, model_name: str, experts_span_dp: bool = False):
        self.model_name = model_name
        self.experts_span_dp = experts_span_dp
        self.latest: dict[tuple[int, int], RankMetrics] = {}

    def collect(self):
        merged: dict[str, Metric] = {}
        for (dp, tp), msg in sorted(self.latest.items()):
            rank = {"model_name": self.model_name, "dp_rank": str(dp), "tp_rank": str(tp)}
            for f in msg.families:
                family = merged.get(f.name)
                if family is None:
                    family = merged[f.name] = Metric(f.name, f.documentation, f.type)
                for s in f.samples:
                    family.add_sample(s.name, {**rank, **s.labels}, s.value)
        yield from merged.values()
        imbalance = imbalance_family(self.model_name, self.latest, self.experts_span_dp)
        if imbalance is not None:
            yield imbalance
