"""The dashboard's "Tenants and SLO admission" row reads what the router exports, with and without
tenant admission: a router without it shows its one queue as the ``default`` tenant's (waiting and
admitted requests by priority) and the tenant admission's counters at 0; with it, per tenant."""

from __future__ import annotations

import asyncio
import json

import pytest
from support.promql_util import DASHBOARD, exported_names, metric_names

from pdserve.router.request_priority import PRIORITY_HEADER
from support.standin_worker import Behavior

pytestmark = pytest.mark.timeout(120)


def tenant_row_names() -> set[str]:
    """The metric names the panels of the dashboard's tenant row read."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Tenants and SLO admission")
    row = []
    for p in panels[start + 1:]:
        if p["type"] == "row":
            break
        row.append(p)
    assert len(row) == 4
    return set().union(*(metric_names(t["expr"]) for p in row for t in p["targets"]))


async def scrape(cluster) -> str:
    async with cluster.client.get(cluster.url + "/metrics") as r:
        return (await r.read()).decode()


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_the_row_reads_the_tenant_families():
    assert tenant_row_names() == {
        "pdserve_router_tenant_queued_requests", "pdserve_router_tenant_admitted_requests",
        "pdserve_router_queue_wait_seconds_bucket", "pdserve_router_rejections_total",
        "pdserve_router_slo_requests_total"}


async def test_a_router_without_tenants_exports_its_queue_as_the_default_tenants(cluster):
    # one slot; the holder streams slowly, so a second request of priority 3 waits in the queue
    await cluster.start(max_concurrent_requests=1, enable_priority_scheduling=True,
                        decode_behavior=Behavior(delay_s=1.0))
    text = await scrape(cluster)
    assert not tenant_row_names() - exported_names(text)
    s = samples(text)
    assert s['pdserve_router_tenant_admitted_requests{tenant="default"}'] == 0
    assert s['pdserve_router_rejections_total{tenant="default",reason="ttft_slo",code="503"}'] == 0
    assert s['pdserve_router_slo_requests_total{tenant="default",outcome="met"}'] == 0
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 20}}
    holder = asyncio.ensure_future(cluster.post("/generate", body))
    await until(lambda: cluster.router.admission.active == 1)
    waiter = asyncio.ensure_future(cluster.post("/generate", body, headers={PRIORITY_HEADER: "3"}))
    await until(lambda: cluster.router.admission.queued == 1)
    s = samples(await scrape(cluster))
    assert s['pdserve_router_tenant_admitted_requests{tenant="default"}'] == 1
    assert s['pdserve_router_tenant_queued_requests{tenant="default",priority="3"}'] == 1
    assert [(await holder)[0], (await waiter)[0]] == [200, 200]


async def test_a_router_with_tenants_exports_them_per_tenant(cluster):
    await cluster.start(tenant_header="x-tenant")
    for tenant in ("chat", "batch"):
        status, _ = await cluster.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                                       headers={"x-tenant": tenant})
        assert status == 200
    text = await scrape(cluster)
    assert not tenant_row_names() - exported_names(text)
    s = samples(text)
    assert s['pdserve_router_queue_wait_seconds_count{tenant="chat",priority="0"}'] == 1
    assert s['pdserve_router_queue_wait_seconds_count{tenant="batch",priority="0"}'] == 1


async def until(cond, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)
