"""A request's way through the tenant admission (``--tenant-config``, ``--tenant-header``,
``--slo-ttft-ms``), in order: its tenant (API key, else header), its cost read from the body
(router/tenancy/request_cost.py), the tenant's token buckets (429 with ``Retry-After``), the
TTFT SLO against the estimate (503 at once, or the last place in the queue), a slot of
``FairAdmission``; then its first byte feeds the prefill-rate estimate and the goodput count.

The body is read before the request queues, since its tokens are its fair-share charge: with
tenants, queued bodies wait in memory (each within ``--max-payload-size``, at most
``--max-connections`` of them).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdserve.router.admission_fair import FairAdmission
from pdserve.router.admission_fair_metrics import TenancyMetrics, rejection_reason
from pdserve.router.config import RouterConfig
from pdserve.router.errors import RouterError
from pdserve.router.tenancy.request_cost import request_cost
from pdserve.router.tenancy.request_tenant import TenantNamer, key_tenant
from pdserve.router.tenancy.slo import judge, request_slo_ms, slo_unreachable
from pdserve.router.tenancy.tenant_limits import TenantLimits
from pdserve.router.tenancy.ttft_estimator import PrefillRateEstimator, PrefillTicket


@dataclass
class Admitted:
    """A request holding a slot of the tenant admission, until ``TenantGate.finish``."""

    tenant: str
    priority: int
    slo_ms: float | None
    arrived: float  # time.perf_counter() at arrival
    ticket: PrefillTicket


class TenantGate:
    def __init__(self, config: RouterConfig, registry: CollectorRegistry):
        self.config = config
        table = config.tenant_table
        self.owners = table.key_owners()
        self.namer = TenantNamer(table, config.tenant_header)
        self.limits = TenantLimits(table)
        self.estimator = PrefillRateEstimator()
        self.admission = FairAdmission(config.max_concurrent_requests, config.queue_size,
                                       config.queue_timeout_secs, config.schedule_low_priority_values_first,
                                       table)
        self.metrics = TenancyMetrics(self.admission, registry)

    def key_tenant(self, headers: Mapping[str, str]) -> str | None:
        """The tenant whose key the request carries (it passes the inference key check)."""
        return key_tenant(headers.get("Authorization", ""), self.owners)

    async def admit(self, tenant: str, headers: Mapping[str, str], body: dict, priority: int,
                    arrived: float) -> Admitted:
        """Hold a slot for the request, or raise its RouterError (counted by reason)."""
        try:
            slo_ms = request_slo_ms(headers, self.config.slo_ttft_ms)
            cost = request_cost(body)
            self.limits.check(tenant, cost.tokens, time.monotonic())
            last = False
            if slo_ms is not None:
                ahead = self.admission.prompt_tokens_ahead(tenant, priority, cost.prompt_tokens)
                estimate = self.estimator.estimate_s(ahead, cost.prompt_tokens)
                decision = judge(slo_ms, estimate)
                if decision.miss:
                    if self.config.slo_miss_policy == "reject":
                        raise slo_unreachable(slo_ms, decision)
                    last = True
            queued_at = time.perf_counter()
            await self.admission.acquire(priority, tenant, cost.tokens, cost.prompt_tokens, last)
        except RouterError as err:
            reason = rejection_reason(err)
            if reason is not None:
                self.metrics.rejections.inc(tenant, reason, str(err.status))
            raise
        now = time.perf_counter()
        self.metrics.wait.child(tenant, str(priority)).observe(now - queued_at)
        return Admitted(tenant, priority, slo_ms, arrived, self.estimator.admitted(cost.prompt_tokens, now))

    def first_byte(self, admitted: Admitted, status: int) -> None:
        """The answer's head leaves: a rate sample and the SLO outcome when it is a success."""
        if status >= 400:
            self.estimator.abandoned(admitted.ticket)
            return
        now = time.perf_counter()
        self.estimator.first_byte(admitted.ticket, now)
        if admitted.slo_ms is not None:
            met = (now - admitted.arrived) * 1000.0 <= admitted.slo_ms
            self.metrics.slo.inc(admitted.tenant, "met" if met else "missed")

    def release(self, admitted: Admitted, failed: bool) -> None:
        """The slot goes back; a request that failed before its first byte gives no sample."""
        self.admission.release(admitted.tenant)
        if failed:
            self.estimator.abandoned(admitted.ticket)
