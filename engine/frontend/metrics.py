"""Prometheus metrics of the engine server, rendered as the text exposition format.

Counters and histograms are updated by the tokenizer manager as requests move;
per-rank gauges (running, waiting, KV usage) come from the ranks' latest
``SchedulerStats`` at render time. No global registry: the server owns one
``ServerMetrics``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pdserve.engine.messages import SchedulerStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        cum = 0
        for b, c in zip(self.buckets, self.counts):
            cum += c
            lines.append(f'{name}_bucket{{le="{b}"}} {cum}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.count}")
        return lines


class ServerMetrics:
    def __init__(self, dp_size: int, model_name: str):
        self.dp_size = dp_size
        self.model_name = model_name
        self.requests_by_rank = [0] * dp_size  # sequences sent to each rank
        self.finished_by_reason: dict[str, int] = {}
        self.http_requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def on_http(self, path: str, status: int) -> None:
        key = (path, status)
        self.http_requests[key] = self.http_requests.get(key, 0) + 1

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int, cached: int, e2e: float) -> None:
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += completion_tokens
        self.cached_tokens += cached
        self.e2e.observe(e2e)

    def render(self, stats: list[SchedulerStats | None], inflight: list[int]) -> str:
        m = f'model_name="{self.model_name}"'
        out: list[str] = []

        def counter(name: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} counter"])
            out.extend(f"{name}{{{labels}}} {value}" for labels, value in samples)

        def gauge(name: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge"])
            out.extend(f"{name}{{{labels}}} {value}" for labels, value in samples)

        ranks = range(self.dp_size)
        counter(
            "pdserve_requests_total",
            "Sequences dispatched, per DP rank.",
            [(f'{m},dp_rank="{r}"', self.requests_by_rank[r]) for r in ranks],
        )
        counter(
            "pdserve_requests_finished_total",
            "Sequences finished, per finish reason.",
            [(f'{m},reason="{k}"', v) for k, v in sorted(self.finished_by_reason.items())],
        )
        counter(
            "pdserve_http_requests_total",
            "HTTP requests, per path and status.",
            [(f'path="{p}",status="{s}"', v) for (p, s), v in sorted(self.http_requests.items())],
        )
        counter("pdserve_prompt_tokens_total", "Prompt tokens of finished sequences.", [(m, self.prompt_tokens)])
        counter("pdserve_generation_tokens_total", "Generated tokens of finished sequences.", [(m, self.generation_tokens)])
        counter("pdserve_cached_tokens_total", "Prompt tokens served from the prefix cache.", [(m, self.cached_tokens)])

        def per_rank(attr) -> list[tuple[str, float]]:
            return [(f'{m},dp_rank="{r}"', attr(stats[r])) for r in ranks if stats[r] is not None]

        gauge("pdserve_num_running_reqs", "Running requests per DP rank.", per_rank(lambda s: s.num_running))
        gauge("pdserve_num_waiting_reqs", "Waiting requests per DP rank.", per_rank(lambda s: s.num_waiting))
        gauge(
            "pdserve_inflight_requests",
            "Sequences the HTTP process has in flight per DP rank.",
            [(f'{m},dp_rank="{r}"', inflight[r]) for r in ranks],
        )
        gauge("pdserve_kv_free_pages", "Free KV pages per DP rank.", per_rank(lambda s: s.num_free_pages))
        gauge("pdserve_kv_total_pages", "KV pages per DP rank.", per_rank(lambda s: s.num_total_pages))
        gauge(
            "pdserve_kv_usage",
            "Fraction of KV pages in use per DP rank.",
            per_rank(lambda s: round(1.0 - s.num_free_pages / max(s.num_total_pages, 1), 6)),
        )
        for name, hist, help_ in (
            ("pdserve_time_to_first_token_seconds", self.ttft, "Time to first token."),
            ("pdserve_time_per_output_token_seconds", self.tpot, "Time per output token after the first."),
            ("pdserve_e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
        ):
            out.extend(hist.render(name, help_))
        return "\n".join(out) + "\n"
