"""Prometheus metrics of the router, rendered as text for ``GET /metrics``.

Kept as plain dicts keyed by label tuples (no client library): the request
path only increments integers, and rendering happens when scraped.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0)


class Histogram:
    __slots__ = ("buckets", "counts", "total", "n")

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, labels: str = "") -> list[str]:
        lines, cum = [], 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts):
            cum += count
            lines.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cum}')
        lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}')
        lbl = f"{{{labels}}}" if labels else ""
        lines.append(f"{name}_sum{lbl} {self.total}")
        lines.append(f"{name}_count{lbl} {self.n}")
        return lines


class RouterMetrics:
    def __init__(self):
        # (worker url, leg) -> count
        self.leg_requests: dict[tuple[str, str], int] = defaultdict(int)
        self.leg_errors: dict[tuple[str, str], int] = defaultdict(int)
        self.leg_retries: dict[tuple[str, str], int] = defaultdict(int)
        # (route, status) -> count
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.retries = 0
        self.ttft = Histogram()
        self.e2e = Histogram()

    def render(self, registry) -> str:
        out = []

        def counter(name: str, help_: str, data: dict, label_names: tuple[str, ...]):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} counter")
            for key, value in sorted(data.items()):
                labels = ",".join(f'{n}="{v}"' for n, v in zip(label_names, key))
                out.append(f"{name}{{{labels}}} {value}")

        counter("pdserve_router_requests_total", "Client requests by route and HTTP status.",
                self.requests, ("route", "status"))
        counter("pdserve_router_worker_requests_total", "Requests sent to a worker, by leg.",
                self.leg_requests, ("worker", "leg"))
        counter("pdserve_router_worker_errors_total", "Failed legs, by worker and leg.",
                self.leg_errors, ("worker", "leg"))
        counter("pdserve_router_worker_retries_total",
                "Retries caused by a failed leg, by the worker and leg that failed.",
                self.leg_retries, ("worker", "leg"))
        out.append("# HELP pdserve_router_retries_total Retries of client requests on a new pair.")
        out.append("# TYPE pdserve_router_retries_total counter")
        out.append(f"pdserve_router_retries_total {self.retries}")
        out.append("# HELP pdserve_router_worker_in_flight Requests in flight on a worker.")
        out.append("# TYPE pdserve_router_worker_in_flight gauge")
        out.append("# HELP pdserve_router_worker_healthy 1 when the worker is in rotation.")
        healthy = []
        for w in registry.workers():
            out.append(f'pdserve_router_worker_in_flight{{worker="{w.url}",role="{w.role}"}} {w.load}')
            healthy.append(f'pdserve_router_worker_healthy{{worker="{w.url}",role="{w.role}"}} '
                           f"{int(w.healthy)}")
        out.append("# TYPE pdserve_router_worker_healthy gauge")
        out.extend(healthy)
        for name, hist, help_ in (("pdserve_router_ttft_seconds", self.ttft,
                                   "Time to the first byte sent to the client."),
                                  ("pdserve_router_e2e_seconds", self.e2e,
                                   "End-to-end request latency at the router.")):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            out.extend(hist.render(name))
        return "\n".join(out) + "\n"
