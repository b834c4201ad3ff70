"""Every router metric the Grafana dashboard plots is in /metrics of a router that has served
nothing yet: the labelled counters start at 0 for their known label values (otherwise a panel
such as retries-by-cause reads "no data" on a healthy cluster)."""

from __future__ import annotations

from support.promql_util import dashboard_exprs, exported_names, metric_names

from pdserve.router.admission import Admission
from pdserve.router.admission_fair_metrics import TenancyFamiliesOff
from pdserve.router.metrics import RETRY_CAUSES, RouterMetrics
from pdserve.router.server import INFERENCE_ROUTES
from pdserve.router.workers.worker_registry import WorkerRegistry


def test_a_fresh_router_exports_every_router_metric_the_dashboard_plots():
    metrics = RouterMetrics(WorkerRegistry(), routes=INFERENCE_ROUTES)
    # as router/server.py builds it without tenants: the tenant families, all the default tenant's
    metrics.registry.register(TenancyFamiliesOff(Admission(-1, 256, 0.0)))
    text = metrics.render().decode()
    wanted = {n for n in set().union(*map(metric_names, dashboard_exprs())) if n.startswith("pdserve_router_")}
    assert "pdserve_router_retries_by_cause_total" in wanted
    assert not wanted - exported_names(text), sorted(wanted - exported_names(text))
    for cause in RETRY_CAUSES:
        assert f'pdserve_router_retries_by_cause_total{{leg="prefill",cause="{cause}"}} 0.0' in text
    assert 'pdserve_router_requests_total{route="/v1/chat/completions",status="200"} 0.0' in text
    assert 'pdserve_router_local_prefill_decisions_total{reason="short"} 0.0' in text
    assert 'pdserve_router_prefills_total{mode="local_refused"} 0.0' in text
    assert 'pdserve_router_rejections_total{tenant="default",reason="ttft_slo",code="503"} 0.0' in text
