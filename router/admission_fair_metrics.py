"""The tenant admission's figures on ``/metrics``: requests waiting and holding a slot per tenant
and priority (read from ``FairAdmission`` at scrape time), the wait in the queue, the requests
refused by tenant and reason, and goodput (requests whose TTFT met their SLO) by tenant.

Tenant names are bounded (router/tenancy/request_tenant.py keeps at most 1024 not in the file),
so the labels are too. A router without tenant admission declares the same families without
samples (``TenancyFamiliesOff``), so the dashboard's tenant panels read "no data" rather than an
unknown metric, and one dashboard serves both kinds of router."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdserve.router.admission import Admission
from pdserve.router.admission_fair import FairAdmission
from pdserve.router.errors import RouterError
from pdserve.router.tenancy.tenant_config import DEFAULT_TENANT
from pdserve.router.metric_cells import CounterCells, HistogramCells
from pdserve.router.tenancy.slo import SLO_HEADER

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# why a request was refused: the tenant's buckets, the queue, and the SLO estimate
REASONS = ("requests_per_second", "tokens_per_second", "queue_size", "queue_timeout_secs", "ttft_slo")
WAIT_DOC = "Time a request waited for an admission slot, by tenant and priority."
REJECTIONS_DOC = ("Requests refused by the tenant admission, by tenant, reason (requests_per_second, "
                  "tokens_per_second: 429 over the tenant's bucket; queue_size, queue_timeout_secs: 429 from "
                  "the queue; ttft_slo: 503, the estimated TTFT misses the SLO) and status.")
SLO_DOC = ("Requests with a TTFT SLO that reached their first byte, by tenant and outcome: met (goodput) "
           "or missed.")
QUEUED_DOC = "Requests waiting for an admission slot, by tenant and priority."
ADMITTED_DOC = "Requests holding an admission slot, by tenant."


def rejection_reason(err: RouterError) -> str | None:
    """The reason label of a refusal by the tenant admission (None: not one of its refusals)."""
    if err.status == 503 and err.param == SLO_HEADER:
        return "ttft_slo"
    if err.status == 429 and err.param in REASONS:
        return err.param
    return None


class TenancyMetrics:
    def __init__(self, admission: FairAdmission, registry: CollectorRegistry):
        self.admission = admission
        self.wait = HistogramCells("pdserve_router_queue_wait_seconds", WAIT_DOC, WAIT_BUCKETS, registry,
                                   labels=("tenant", "priority"))
        self.rejections = CounterCells("pdserve_router_rejections_total", REJECTIONS_DOC,
                                       ("tenant", "reason", "code"), registry)
        self.slo = CounterCells("pdserve_router_slo_requests_total", SLO_DOC, ("tenant", "outcome"), registry)
        registry.register(self)

    def collect(self):
        a = self.admission
        queued = GaugeMetricFamily("pdserve_router_tenant_queued_requests", QUEUED_DOC,
                                   labels=("tenant", "priority"))
        for (tenant, priority), n in sorted(a.queued_by_tenant_priority().items()):
            queued.add_metric((tenant, str(priority)), n)
        active = GaugeMetricFamily("pdserve_router_tenant_admitted_requests", ADMITTED_DOC, labels=("tenant",))
        for tenant, n in sorted(a.active_by_tenant.items()):
            active.add_metric((tenant,), n)
        yield queued
        yield active


class TenancyFamiliesOff:
    """The same families for a router without tenant admission: every request is the ``default``
    tenant's (docs/ROUTER.md), the plain queue's waiting and admitted requests are that tenant's,
    and the tenant admission refused nothing (its counters at 0); the wait is not measured."""

    def __init__(self, admission: Admission):
        self.admission = admission

    def collect(self):
        a = self.admission
        queued = GaugeMetricFamily("pdserve_router_tenant_queued_requests", QUEUED_DOC, labels=("tenant", "priority"))
        for priority, n in sorted((a.queued_by_priority() or {0: 0}).items()):
            queued.add_metric((DEFAULT_TENANT, str(priority)), n)
        active = GaugeMetricFamily("pdserve_router_tenant_admitted_requests", ADMITTED_DOC, labels=("tenant",))
        active.add_metric((DEFAULT_TENANT,), a.active)
        rejections = CounterMetricFamily("pdserve_router_rejections", REJECTIONS_DOC,
                                         labels=("tenant", "reason", "code"))
        for reason in REASONS:
            rejections.add_metric((DEFAULT_TENANT, reason, "503" if reason == "ttft_slo" else "429"), 0)
        slo = CounterMetricFamily("pdserve_router_slo_requests", SLO_DOC, labels=("tenant", "outcome"))
        for outcome in ("met", "missed"):
            slo.add_metric((DEFAULT_TENANT, outcome), 0)
        yield queued
        yield active
        yield HistogramMetricFamily("pdserve_router_queue_wait_seconds", WAIT_DOC, labels=("tenant", "priority"))
        yield rejections
        yield slo
