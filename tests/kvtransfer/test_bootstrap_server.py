from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from pdserve.engine.http_limits import HttpLimits
from pdserve.kvtransfer import BootstrapServer

pytestmark = pytest.mark.timeout(30)


def reg(dp=0, tp=0, endpoint="127.0.0.1:7000", page_size=16, **kw):
    return {"dp_rank": dp, "tp_rank": tp, "endpoint": endpoint, "page_size": page_size, "kv_dtype": "bfloat16",
            "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, **kw}


@pytest.fixture
def server():
    s = BootstrapServer("127.0.0.1", 0, dp_size=2).start_in_thread()
    yield s
    s.stop_thread()


def call(server, method, path, body=None):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_register_and_route(server):
    assert call(server, "GET", "/health")[0] == 200
    assert call(server, "PUT", "/route", reg(0))[0] == 200
    status, body = call(server, "GET", "/route")
    assert status == 503 and "1 of 2" in body["error"]  # dp 1 not registered yet
    assert call(server, "PUT", "/route", reg(1, endpoint="127.0.0.1:7001"))[0] == 200
    assert call(server, "PUT", "/route", reg(1, endpoint="127.0.0.1:7001"))[0] == 200  # idempotent
    status, topo = call(server, "GET", "/route")
    assert status == 200 and [r["endpoint"] for r in topo["ranks"]] == ["127.0.0.1:7000", "127.0.0.1:7001"]
    status, one = call(server, "GET", "/route?dp_rank=1&tp_rank=0")
    assert status == 200 and one["endpoint"] == "127.0.0.1:7001" and one["page_size"] == 16


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "malformed"),
        (b"[]", "malformed"),
        ({"dp_rank": 0}, "malformed"),
        (reg(extra_field=1), "malformed"),
        (reg(dp=5), "dp_rank 5 out of range"),
        (reg(tp=1), "tp_rank 1 out of range"),
        (reg(endpoint="nohost"), "endpoint must be host:port"),
        (reg(page_size=0), "page_size must be >= 1"),
    ],
)
def test_malformed_registrations_get_400(server, body, message):
    status, resp = call(server, "PUT", "/route", body)
    assert status == 400 and message in resp["error"], resp


def test_conflicting_registrations_get_400(server):
    assert call(server, "PUT", "/route", reg(0))[0] == 200
    status, resp = call(server, "PUT", "/route", reg(0, endpoint="127.0.0.1:9999"))
    assert status == 400 and "already registered" in resp["error"]
    status, resp = call(server, "PUT", "/route", reg(1, endpoint="127.0.0.1:7000"))
    assert status == 400 and "already registered by dp 0" in resp["error"]
    status, resp = call(server, "PUT", "/route", reg(1, endpoint="127.0.0.1:7001", page_size=32))
    assert status == 400 and "page_size: 16 vs 32" in resp["error"]
    status, resp = call(server, "GET", "/route?dp_rank=x")
    assert status == 503  # still not all ranks


async def test_runs_as_task_in_a_running_loop():
    s = BootstrapServer("127.0.0.1", 0)
    await s.start()
    try:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.put(f"http://127.0.0.1:{s.port}/route", json=reg()) as r:
                assert r.status == 200
            async with http.get(f"http://127.0.0.1:{s.port}/route?dp_rank=0") as r:
                assert (await r.json())["endpoint"] == "127.0.0.1:7000"
    finally:
        await s.stop()


def test_the_bootstrap_client(server):
    """The one client of /route (prefill ranks register with it, decode ranks look them up)."""
    import msgspec

    from pdserve.kvtransfer import bootstrap_client as bc
    from pdserve.kvtransfer.messages import RankRegistration

    assert server.port != 0  # the bound port, read back from the runner
    with pytest.raises(urllib.error.HTTPError) as e:
        bc.fetch_topology("127.0.0.1", server.port)
    assert e.value.code == 503
    for dp in (0, 1):
        bc.register_rank("127.0.0.1", server.port, msgspec.convert(reg(dp, endpoint=f"127.0.0.1:{7000 + dp}"),
                                                                   RankRegistration))
    topo = bc.fetch_topology("127.0.0.1", server.port)
    assert topo.dp_size == 2 and [r.endpoint for r in topo.ranks] == ["127.0.0.1:7000", "127.0.0.1:7001"]
    assert bc.fetch_rank("127.0.0.1", server.port, 1).endpoint == "127.0.0.1:7001"
    with pytest.raises(urllib.error.HTTPError) as e:
        bc.register_rank("127.0.0.1", server.port, msgspec.convert(reg(5), RankRegistration))
    assert e.value.code == 400


def test_tp_ranks_all_needed_and_missing_ones_named():
    """A prefill server of TP 2: GET /route answers 503 naming the missing TP rank until both registered."""
    s = BootstrapServer("127.0.0.1", 0, dp_size=1, tp_size=2).start_in_thread()
    try:
        assert call(s, "PUT", "/route", reg(0, 0, tp_size=2, num_kv_heads=2, kv_heads=4))[0] == 200
        status, body = call(s, "GET", "/route")
        assert status == 503 and "missing: dp 0 tp 1" in body["error"], body
        # a rank of another TP size is refused
        status, body = call(s, "PUT", "/route", reg(0, 1, endpoint="127.0.0.1:7001", num_kv_heads=2, kv_heads=4))
        assert status == 400 and "tp_size 1" in body["error"], body
        assert call(s, "PUT", "/route", reg(0, 1, endpoint="127.0.0.1:7001", tp_size=2, num_kv_heads=2,
                                            kv_heads=4))[0] == 200
        status, topo = call(s, "GET", "/route")
        assert status == 200 and topo["tp_size"] == 2 and [r["tp_rank"] for r in topo["ranks"]] == [0, 1]
    finally:
        s.stop_thread()


def test_connections_over_the_cap_are_refused_and_a_stalled_body_is_408():
    """The bootstrap server's listener has its server's limits: with ``max_connections`` open the
    next connection is a 503 naming the flag, and on an open one a PUT body that stops arriving
    is a 408."""
    s = BootstrapServer("127.0.0.1", 0, limits=HttpLimits(header_timeout=5.0, max_connections=2),
                        read_timeout=0.5).start_in_thread()
    conns = []
    try:
        for _ in range(2):
            held = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            conns.append(held)
            held.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert held.recv(4096).startswith(b"HTTP/1.1 200")
        extra = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        conns.append(extra)
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections (2)" in answer, answer
        conns[0].sendall(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        answer = conns[0].recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive" in answer, answer
    finally:
        for c in conns:
            c.close()
        s.stop_thread()
