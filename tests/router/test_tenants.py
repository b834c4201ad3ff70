"""Tenants through the router's HTTP server, against stand-in workers: a tenant over its token
bucket gets 429 with Retry-After while another is served; a saturated queue is shared by weight
(deficit round-robin on tokens); a tenant's concurrency cap queues its requests (429 when the
queue is full) while other tenants pass; SLO admission answers 503 with the reason for requests
whose estimated TTFT misses their target and serves the others (or, deprioritized, last); the
figures are on /metrics; a bad tenant file fails the start naming the field; a full queue sheds
the flooding tenant's requests, not a newcomer of another tenant."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.router.admission_fair import FairAdmission
from pdserve.router.cli import main
from pdserve.router.config import RouterConfig
from pdserve.router.errors import RouterError
from pdserve.router.tenancy.tenant_config import parse_tenant_table
from support.standin_worker import Behavior

pytestmark = pytest.mark.timeout(120)

TENANT = "x-tenant"


def tenant_file(tmp_path, tenants: dict, default: dict | None = None) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"default": default or {}, "tenants": tenants}))
    return str(path)


def gen(tag: str, max_new_tokens: int = 2) -> dict:
    return {"text": tag, "sampling_params": {"max_new_tokens": max_new_tokens}}


async def post(cluster, body: dict, tenant: str | None = None, headers: dict | None = None):
    """(status, JSON body, response headers)"""
    h = {**({TENANT: tenant} if tenant else {}), **(headers or {})}
    async with cluster.client.post(cluster.url + "/generate", json=body, headers=h) as r:
        return r.status, await r.json(content_type=None), r.headers


async def metrics(cluster) -> str:
    return (await (await cluster.client.get(cluster.url + "/metrics")).read()).decode()


async def until(cond, what: str, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def served_tags(worker) -> list[str]:
    return [r.body["text"] for r in worker.requests if r.path == "/generate"]


async def test_a_tenant_over_its_bucket_gets_429_with_retry_after_while_another_is_served(cluster, tmp_path):
    cfg = tenant_file(tmp_path, {"a": {"requests_per_second": 0.2}, "c": {"tokens_per_second": 50,
                                                                         "api_keys": ["sk-c"]}})
    await cluster.start(tenant_config=cfg, tenant_header=TENANT, api_key="sk-router")
    key = {"Authorization": "Bearer sk-router"}
    assert (await post(cluster, gen("a-1"), "a", key))[0] == 200
    status, body, headers = await post(cluster, gen("a-2"), "a", key)
    assert status == 429 and body["error"]["param"] == "requests_per_second"
    assert "tenant 'a'" in body["error"]["message"] and "requests_per_second" in body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    for i in range(5):  # b has no limit: served while a is refused
        assert (await post(cluster, gen(f"b-{i}"), "b", key))[0] == 200
    assert (await post(cluster, gen("a-3"), "a", key))[0] == 429
    # a tenant's key opens the router and names the tenant, whatever the header says
    c_key = {"Authorization": "Bearer sk-c"}
    assert (await post(cluster, gen("c-1", 30), "a", c_key))[0] == 200  # 2 + 30 tokens of 50
    status, body, headers = await post(cluster, gen("c-2", 30), "b", c_key)
    assert status == 429 and body["error"]["param"] == "tokens_per_second" and "Retry-After" in headers
    assert (await post(cluster, gen("x"), "a", {"Authorization": "Bearer wrong"}))[0] == 401
    async with cluster.client.get(cluster.url + "/v1/models", headers=c_key) as r:
        assert r.status == 200  # on every inference route
    text = await metrics(cluster)
    assert 'pdserve_router_rejections_total{tenant="a",reason="requests_per_second",code="429"} 2.0' in text
    assert 'pdserve_router_rejections_total{tenant="c",reason="tokens_per_second",code="429"} 1.0' in text
    assert served_tags(cluster.decodes[0]) == ["a-1", *(f"b-{i}" for i in range(5)), "c-1"]


async def test_a_saturated_queue_is_shared_by_weight(cluster, tmp_path):
    cfg = tenant_file(tmp_path, {"a": {"weight": 3}, "b": {"weight": 1}})
    await cluster.start(tenant_config=cfg, tenant_header=TENANT, max_concurrent_requests=1, queue_size=64,
                        decode_behavior=Behavior(hang=True))
    dec = cluster.decodes[0]
    holder = asyncio.ensure_future(post(cluster, gen("hold"), "h"))
    await until(lambda: dec.requests, "the holder at the decode worker")
    # each request costs 1 prompt token (4 characters) + 1023 = 1024 tokens
    posts = []
    for tenant in ("a", "b"):  # a's flood arrives first
        for i in range(16):
            posts.append(asyncio.ensure_future(post(cluster, gen(f"{tenant}{i:03d}", 1023), tenant)))
            await until(lambda: cluster.router.admission.queued == len(posts), "the request queued")
    text = await metrics(cluster)
    assert 'pdserve_router_tenant_queued_requests{tenant="a",priority="0"} 16.0' in text
    assert 'pdserve_router_tenant_queued_requests{tenant="b",priority="0"} 16.0' in text
    dec.behavior.hang = False
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    results = await asyncio.gather(*posts)
    assert [r[0] for r in results] == [200] * 32
    order = [tag[0] for tag in served_tags(dec)[1:]]
    # weight 3 against 1: a gets three turns to b's one, though a's 16 queued first
    assert "".join(order[:16]) == "aaab" * 4
    assert order.count("a") == order.count("b") == 16
    assert cluster.router.admission.queued == 0 and cluster.router.admission.active == 0


async def test_a_tenant_at_its_concurrency_cap_queues_while_others_pass(cluster, tmp_path):
    cfg = tenant_file(tmp_path, {"a": {"max_concurrent": 1}})
    await cluster.start(tenant_config=cfg, tenant_header=TENANT, queue_size=1,
                        decode_behavior=Behavior(hang=True))
    dec = cluster.decodes[0]
    a1 = asyncio.ensure_future(post(cluster, gen("a1"), "a"))
    await until(lambda: len(dec.requests) == 1, "a1 at the decode worker")
    a2 = asyncio.ensure_future(post(cluster, gen("a2"), "a"))
    await until(lambda: cluster.router.admission.queued == 1, "a2 queued")
    others = [asyncio.ensure_future(post(cluster, gen(f"b{i}"), "b")) for i in range(3)]
    await until(lambda: len(dec.requests) == 4, "b's requests at the decode worker")
    status, body, _ = await post(cluster, gen("a3"), "a")  # a's queue (of 1) is full
    assert status == 429 and body["error"]["param"] == "queue_size"
    assert served_tags(dec) == ["a1", "b0", "b1", "b2"]
    assert cluster.router.admission.active_by_tenant == {"a": 1, "b": 3}
    dec.behavior.hang = False
    a1.cancel()  # a's slot frees: a2 goes
    await asyncio.gather(a1, return_exceptions=True)
    assert (await a2)[0] == 200
    assert served_tags(dec)[-1] == "a2"
    for t in others:
        t.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    await until(lambda: cluster.router.admission.active == 0, "every slot back")
    assert cluster.router.admission.queued == 0


async def test_slo_admission_rejects_what_cannot_make_its_target_and_serves_the_rest(cluster):
    await cluster.start(slo_ttft_ms=30_000, max_concurrent_requests=1, queue_size=64,
                        decode_behavior=Behavior(delay_s=0.3))
    dec = cluster.decodes[0]
    # until a first byte the router knows no prefill rate: the first request is admitted as it is
    assert (await post(cluster, gen("warm-" + "0" * 43, 2)))[0] == 200
    estimator = cluster.router.tenants.estimator
    assert estimator.rate is not None and estimator.prefilling == 0
    one = 12 / estimator.rate * 1000  # ms to the first byte of one such request (12 prompt tokens)
    # an overload: 10 at once with one slot; a target of 2.5 requests' time admits the first
    # two, whose estimates are 1x and 2x, and rejects those behind them
    slo = {"x-pdserve-ttft-slo-ms": f"{2.5 * one:.0f}"}
    posts = [asyncio.ensure_future(post(cluster, gen(f"req-{i:02d}-" + "x" * 41), headers=slo))
             for i in range(10)]
    results = await asyncio.gather(*posts)
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 503} and statuses.count(503) >= 1 and statuses.count(200) >= 1
    for status, body, _ in results:
        if status == 503:
            assert body["error"]["param"] == "x-pdserve-ttft-slo-ms"
            assert body["error"]["message"].startswith("ttft_slo_unreachable")
    # the rejected never reached a worker
    assert len(served_tags(dec)) == 1 + statuses.count(200)
    text = await metrics(cluster)
    assert (f'pdserve_router_rejections_total{{tenant="default",reason="ttft_slo",code="503"}} '
            f'{float(statuses.count(503))}') in text
    met = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("pdserve_router_slo_requests_total{"))
    assert met == 1 + statuses.count(200)  # every served request counted, met or missed


async def test_deprioritize_queues_a_request_that_misses_its_slo_after_the_others(cluster):
    await cluster.start(slo_ttft_ms=60_000, slo_miss_policy="deprioritize", max_concurrent_requests=1,
                        decode_behavior=Behavior(delay_s=0.1))
    dec = cluster.decodes[0]
    assert (await post(cluster, gen("warm")))[0] == 200  # a first byte: the rate is known
    dec.behavior.hang = True
    holder = asyncio.ensure_future(post(cluster, gen("hold")))
    await until(lambda: len(served_tags(dec)) == 2, "the holder at the decode worker")
    late = asyncio.ensure_future(post(cluster, gen("late"), headers={"x-pdserve-ttft-slo-ms": "1"}))
    await until(lambda: cluster.router.admission.queued == 1, "the late request queued")
    ok = asyncio.ensure_future(post(cluster, gen("ok")))
    await until(lambda: cluster.router.admission.queued == 2, "the second request queued")
    dec.behavior.hang = False
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    assert [(await late)[0], (await ok)[0]] == [200, 200]
    assert served_tags(dec)[2:] == ["ok", "late"]  # it came first but could not make its target
    assert 'pdserve_router_slo_requests_total{tenant="default",outcome="missed"} 1.0' in await metrics(cluster)


async def test_the_slo_header_without_slo_admission_is_a_400(cluster):
    await cluster.start()
    status, body, _ = await post(cluster, gen("x"), headers={"x-pdserve-ttft-slo-ms": "100"})
    assert status == 400 and body["error"]["param"] == "x-pdserve-ttft-slo-ms"
    assert cluster.router.tenants is None


def test_a_bad_tenant_file_fails_the_start_naming_the_field(tmp_path, capsys):
    bad = tenant_file(tmp_path, {"a": {"weight": 2, "tokens_per_secnd": 10}})
    with pytest.raises(ValueError, match=r"tenants\.a: unknown field 'tokens_per_secnd'"):
        RouterConfig(tenant_config=bad)
    (tmp_path / "t.yaml").write_text("tenants:\n  b:\n    weight: 0\n")
    with pytest.raises(SystemExit) as e:
        main(["--tenant-config", str(tmp_path / "t.yaml")])
    assert e.value.code == 2
    assert "tenants.b: weight must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="slo_miss_policy"):
        RouterConfig(slo_miss_policy="drop")
    with pytest.raises(ValueError, match="tenant_header"):
        RouterConfig(tenant_header="Authorization")


async def test_a_full_queue_sheds_the_flooding_tenant_not_the_newcomer():
    table = parse_tenant_table({"tenants": {"a": {"weight": 1}, "b": {"weight": 1}}})
    adm = FairAdmission(1, 4, 60.0, False, table)
    await adm.acquire(0, "h")
    a = [asyncio.ensure_future(adm.acquire(0, "a", 10)) for _ in range(4)]
    await until(lambda: adm.queued == 4, "a's four queued")
    b = asyncio.ensure_future(adm.acquire(0, "b", 10))
    await until(lambda: a[3].done(), "a's last shed")
    with pytest.raises(RouterError) as e:
        a[3].result()
    assert e.value.status == 429 and e.value.param == "queue_size" and "'b'" in e.value.message
    with pytest.raises(RouterError):  # a holds the most of the queue: its own newcomer is refused
        await adm.acquire(0, "a", 10)
    assert adm.queued_by_tenant_priority() == {("a", 0): 3, ("b", 0): 1} and adm.displaced == 1
    pending = {**{f: "a" for f in a[:3]}, b: "b"}
    served, last = [], "h"
    while pending:  # each finished slot goes to the next by DRR: a and b take turns
        adm.release(last)
        await until(lambda: any(f.done() for f in pending), "a slot handed over")
        (done,) = [f for f in pending if f.done()]
        last = pending.pop(done)
        served.append(last)
    assert served == ["a", "b", "a", "a"]
    adm.release(last)
    assert adm.active == 0 and adm.queued == 0


async def test_the_ttft_estimate_counts_a_flooding_tenant_only_up_to_its_turns():
    table = parse_tenant_table({"tenants": {"a": {"weight": 1}, "b": {"weight": 2}}})
    adm = FairAdmission(1, 100, 60.0, True, table)
    await adm.acquire(0, "h")
    flood = [asyncio.ensure_future(adm.acquire(5, "a", 110, 100)) for _ in range(10)]
    urgent = asyncio.ensure_future(adm.acquire(1, "c", 60, 50))  # a band before a's (low values first)
    await until(lambda: adm.queued == 11, "the flood queued")
    assert adm.prompt_tokens_ahead("a", 5, 100) == 50 + 1000  # its own tenant's queue: all of it
    # b, weight 2: a's 1000 tokens count up to half of b's (0 queued + 100 of its own)
    assert adm.prompt_tokens_ahead("b", 5, 100) == 50 + 50
    assert adm.prompt_tokens_ahead("b", 0, 100) == 0  # a band before every queued one
    for f in [*flood, urgent]:
        f.cancel()
    await asyncio.gather(*flood, urgent, return_exceptions=True)
    assert adm.queued == 0
