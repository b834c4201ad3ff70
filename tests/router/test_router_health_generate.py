"""The router's /health_generate (every worker generates now, SGLang's gateway has it), its /liveness
and /readiness, and JSON errors from every path of the router: an unknown path is a JSON 404, a
wrong method a JSON 405 (aiohttp answers both in plain text unless told otherwise)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


async def get(cluster, path: str, method: str = "GET"):
    async with cluster.client.request(method, cluster.url + path) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.json(content_type=None)


async def test_health_generate_is_200_only_while_every_worker_generates(cluster):
    await cluster.start(n_prefill=2, n_decode=1)
    status, _, body = await get(cluster, "/health_generate")
    assert status == 200 and body["status"] == "ok"
    assert sorted(w["url"] for w in body["workers"]) == sorted(w.url for w in cluster.prefills + cluster.decodes)
    cluster.prefills[1].behavior.health_status = 503  # one prefill server cannot generate
    status, _, body = await get(cluster, "/health_generate")
    assert status == 503 and body["status"] == "unhealthy"
    assert cluster.prefills[1].url in body["message"] and cluster.prefills[0].url not in body["message"]
    failed = [w for w in body["workers"] if w["status"] != 200]
    assert [w["url"] for w in failed] == [cluster.prefills[1].url]
    # liveness says the process runs; readiness (the periodic probes) still sees a pair
    assert (await get(cluster, "/liveness"))[0] == 200
    assert (await get(cluster, "/readiness"))[0] == 200


async def test_health_generate_needs_both_roles(cluster):
    await cluster.start(n_prefill=1, n_decode=1)
    await cluster.decodes[0].close()  # the decode server is gone
    status, _, body = await get(cluster, "/health_generate")
    assert status == 503 and f"decode {cluster.decodes[0].url}" in body["message"]


async def test_unknown_paths_and_wrong_methods_are_json_errors(cluster):
    await cluster.start()
    for method, path, want in (("GET", "/no/such/path", 404), ("POST", "/v2/chat", 404),
                               ("GET", "/generate", 405), ("DELETE", "/health", 405),
                               ("PUT", "/v1/chat/completions", 405)):
        status, ctype, body = await get(cluster, path, method)
        assert status == want and ctype.startswith("application/json"), (method, path, status, ctype)
        assert body["error"]["code"] == want and path in body["error"]["message"], body
