"""The drain of an engine server's HTTP side (``engine/frontend/drain.py``), in one process: while
draining, new work gets 503 + Retry-After and /health 503 with a draining body; requests in flight
run to their end; what is left at the timeout is failed with a message naming it."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.engine.frontend.drain import DRAIN_KEY, Drain, drain_middleware

pytestmark = pytest.mark.timeout(30)


async def _client(drain: Drain, release: asyncio.Event) -> TestClient:
    async def generate(request):
        await release.wait()
        return web.json_response({"output_ids": [1, 2, 3]})

    async def health(request):
        return web.Response(text="")

    app = web.Application(middlewares=[drain_middleware])
    app[DRAIN_KEY] = drain
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/get_server_info", health)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_draining_refuses_new_work_and_finishes_what_is_in_flight():
    inflight = [0]
    drain = Drain(5.0, lambda: inflight[0])
    release = asyncio.Event()
    client = await _client(drain, release)
    try:
        assert (await client.get("/health")).status == 200
        inflight[0] = 1
        first = asyncio.ensure_future(client.post("/generate", json={}))
        await asyncio.sleep(0.05)
        assert drain.begin() and not drain.begin()  # a second SIGTERM stops at once
        done = asyncio.ensure_future(drain.run(lambda reason: pytest.fail(reason)))
        r = await client.post("/generate", json={})
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert "draining" in (await r.json())["error"]["message"]
        h = await client.get("/health")
        assert h.status == 503 and (await h.json())["status"] == "draining"
        assert (await h.json())["inflight_requests"] == 1
        assert (await client.get("/get_server_info")).status == 200  # info stays served
        await asyncio.sleep(0.2)
        assert not done.done()  # still waiting for the request in flight
        release.set()
        assert (await (await first).json()) == {"output_ids": [1, 2, 3]}
        inflight[0] = 0
        assert await asyncio.wait_for(done, 5) == 0
    finally:
        await client.close()


async def test_timeout_fails_what_is_left_with_a_clear_error():
    failed: list[str] = []
    drain = Drain(0.2, lambda: 0 if failed else 2)
    assert drain.begin()
    assert await drain.run(failed.append) == 2
    assert failed and "graceful shutdown timeout (0.2s)" in failed[0]


def test_zero_timeout_means_no_drain():
    assert not Drain(0.0, lambda: 0).begin()
