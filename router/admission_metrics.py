"""The admission queue's gauges on ``/metrics``, read from ``Admission`` at scrape time: requests
in flight, requests waiting by priority, and requests pushed out of a full queue by a higher one."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.router.admission import Admission


class AdmissionGauges:
    def __init__(self, admission: Admission):
        self.admission = admission

    def collect(self):
        a = self.admission
        active = GaugeMetricFamily("pdserve_router_admitted_requests",
                                   "Requests holding an admission slot (--max-concurrent-requests).")
        active.add_metric((), a.active)
        waiting = GaugeMetricFamily("pdserve_router_queued_requests",
                                    "Requests waiting for an admission slot, by priority "
                                    "(x-pdserve-priority; 0 without it).", labels=("priority",))
        by_priority = a.queued_by_priority() or {0: 0}
        for priority, n in sorted(by_priority.items()):
            waiting.add_metric((str(priority),), n)
        displaced = CounterMetricFamily("pdserve_router_queue_displaced",
                                        "Queued requests answered 429 to make room for a higher priority.")
        displaced.add_metric((), a.displaced)
        yield active
        yield waiting
        yield displaced
