"""The router's queue through its HTTP server, against stand-in workers: with one admission slot
held, requests queued with ``x-pdserve-priority`` reach the workers highest priority first, arrival
order among equals; the queue's depth by priority is on /metrics; a priority header is a 400
naming it when priority scheduling is off."""

from __future__ import annotations

import asyncio

import pytest

from support.standin_worker import Behavior

pytestmark = pytest.mark.timeout(60)


def gen(tag: str) -> dict:
    return {"text": tag, "sampling_params": {"max_new_tokens": 2}}


async def _wait_queued(cluster, n: int) -> None:
    while cluster.router.admission.queued < n:
        await asyncio.sleep(0.01)


async def test_queued_requests_reach_the_workers_by_priority(cluster):
    await cluster.start(max_concurrent_requests=1, queue_size=10, enable_priority_scheduling=True,
                        decode_behavior=Behavior(hang=True))
    dec = cluster.decodes[0]
    holder = asyncio.ensure_future(cluster.post("/generate", gen("holder")))
    while not dec.requests:
        await asyncio.sleep(0.01)
    arrivals = [("low-a", 0), ("low-b", 0), ("high-a", 9), ("mid", 4), ("high-b", 9)]
    posts = []
    for i, (tag, prio) in enumerate(arrivals):
        posts.append(asyncio.ensure_future(
            cluster.post("/generate", gen(tag), headers={"x-pdserve-priority": str(prio)})))
        await _wait_queued(cluster, i + 1)
    metrics = (await (await cluster.client.get(cluster.url + "/metrics")).read()).decode()
    assert 'pdserve_router_queued_requests{priority="9"} 2.0' in metrics
    assert 'pdserve_router_queued_requests{priority="0"} 2.0' in metrics
    dec.behavior.hang = False
    holder.cancel()  # the client goes away: its slot passes to the queue's head
    await asyncio.gather(holder, return_exceptions=True)
    results = await asyncio.gather(*posts)
    assert [status for status, _ in results] == [200] * len(arrivals)
    served = [r.body["text"] for r in dec.requests if r.path == "/generate"][1:]
    assert served == ["high-a", "high-b", "mid", "low-a", "low-b"]
    assert cluster.router.admission.queued == 0 and cluster.router.admission.active == 0


async def test_priority_header_without_the_flag_is_a_400(cluster):
    await cluster.start()
    status, body = await cluster.post("/generate", gen("x"), headers={"x-pdserve-priority": "1"})
    assert status == 400 and body["error"]["param"] == "x-pdserve-priority"
    assert "--enable-priority-scheduling" in body["error"]["message"]
    status, body = await cluster.post("/generate", gen("x"))
    assert status == 200


async def test_a_bad_priority_is_a_400_and_takes_no_slot(cluster):
    await cluster.start(max_concurrent_requests=1, enable_priority_scheduling=True)
    status, body = await cluster.post("/v1/completions", {"prompt": "x", "max_tokens": 2},
                                      headers={"x-pdserve-priority": "urgent"})
    assert status == 400 and "integer" in body["error"]["message"]
    assert cluster.router.admission.active == 0
