"""Security: where the servers listen, and the API key from the router to the servers.

- Every TCP socket a prefill or decode server listens on (HTTP, bootstrap server, the KV manager's
  control socket, the transfer engine) is bound to the configured ``--host``, never a wildcard.
- ``--api-key`` on the router protects every endpoint but ``/health``, ``/metrics`` and the admin
  routes (those take ``--admin-api-key``, here from a file; the inference key does not open them);
  the servers take the same flag and the router forwards the key, so a keyed router + keyed
  servers work end to end.
- KV destinations are page indices checked against the registered pool: proven over the wire in
  ``tests/kvtransfer/test_two_process_transfer.py::test_prefill_validates_registrations_and_destinations``
  and, from a process outside the pair, in ``test_bad_input.py::test_garbage_control_frames_are_rejected_and_logged``.
"""

from __future__ import annotations

import pytest
import requests
from support.pd_stand import Server, greedy_body, prompt_ids
from support.rel_stand import Router, listening

pytestmark = pytest.mark.timeout(300)

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WILDCARDS = {"0.0.0.0", "::"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    admin_key = tmp_path_factory.mktemp("router-admin") / "admin.key"
    admin_key.write_text("an operator's key\n")
    p = Server("rel-key-P", "prefill", "--max-total-tokens", "1024", "--api-key", KEY)
    d = Server("rel-key-D", "decode", "--max-total-tokens", "1024", "--api-key", KEY)
    r = None
    try:
        p.wait_ready()
        d.wait_ready()
        r = Router("rel-key-router", [p], [d], "--api-key", KEY,
                   "--admin-api-key-file", str(admin_key)).wait_ready()
        yield p, d, r
    finally:
        for s in (r, p, d):
            if s is not None:
                s.stop()


def test_internal_endpoints_bind_the_configured_host(keyed):
    """pdserve's own listeners (HTTP, bootstrap server, KV control sockets, the router) bind ``--host``.

    Known exception, upstream: Mooncake's transfer engine listens for its P2P handshake RPC and its
    TCP transport on all interfaces (0.0.0.0 and ::), whatever host it is initialized with; no MC_*
    variable we tried (MC_TCP_BIND_ADDRESS, MC_LEGACY_RPC_PORT_BINDING) narrows it. Those are the
    only wildcard listeners allowed: at most two per scheduler rank. See docs/RELIABILITY.md.
    """
    P, D, R = keyed
    # one request first: the transfer engines and control sockets of both sides are up and in use
    r = requests.post(R.url + "/generate", json=greedy_body(prompt_ids(5, 1), 2), headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    control = requests.get(f"http://{P.host}:{P.bootstrap_port}/route", timeout=10).json()["ranks"][0]["endpoint"]
    assert control.startswith("127.0.0.1:"), control
    for s in (P, D, R):
        socks = listening(s.proc.pid)
        assert socks, f"{s.name}: no listening socket found"
        own = [a for a in socks if a[0] not in WILDCARDS]
        wild = [a for a in socks if a[0] in WILDCARDS]
        assert all(a[0] == "127.0.0.1" for a in own), socks
        assert (s is not R or not wild), f"the router listens on a wildcard address: {socks}"
        assert len(wild) <= 2, f"{s.name}: more wildcard listeners than Mooncake's two: {socks}"
        assert ("127.0.0.1", s.port) in own
    p_own = {port for addr, port in listening(P.proc.pid) if addr == "127.0.0.1"}
    assert {P.port, P.bootstrap_port, int(control.rsplit(":", 1)[1])} <= p_own, p_own
    d_own = [a for a in listening(D.proc.pid) if a[0] == "127.0.0.1"]
    assert len(d_own) >= 2, f"decode: HTTP and the KV control socket on 127.0.0.1: {d_own}"


def test_router_api_key_guards_everything_but_health_and_metrics(keyed):
    P, D, R = keyed
    for path in ("/health", "/metrics"):
        assert requests.get(R.url + path, timeout=10).status_code == 200, path
    guarded_get = ["/v1/models", "/get_model_info", "/model_info", "/get_server_info", "/server_info", "/workers"]
    for path in guarded_get:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = requests.get(R.url + path, headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.status_code, r.text)
            assert "error" in r.json()
        assert requests.get(R.url + path, headers=AUTH, timeout=10).status_code == 200, path
    bodies = {
        "/generate": greedy_body(prompt_ids(6, 2), 2),
        "/v1/completions": {"model": "default", "prompt": "Hi", "max_tokens": 2, "temperature": 0},
        "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    }
    for path, body in bodies.items():
        r = requests.post(R.url + path, json=body, timeout=60)
        assert r.status_code == 401 and "error" in r.json(), (path, r.text)
        r = requests.post(R.url + path, json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, (path, r.text)
    # the worker API: add and remove need the admin key, which the inference key is not
    spec = {"url": "http://127.0.0.1:9", "role": "decode"}
    for headers in ({}, AUTH):
        assert requests.post(R.url + "/workers", json=spec, headers=headers, timeout=10).status_code == 401
        assert requests.delete(R.url + "/workers/" + requests.utils.quote(D.url, safe=""), headers=headers,
                               timeout=10).status_code == 401
    assert [w["url"] for w in requests.get(R.url + "/workers", headers=AUTH, timeout=10).json()["decode"]] == [D.url]


def test_servers_require_the_key_the_router_forwards(keyed):
    P, D, R = keyed
    for s in (P, D):
        assert requests.get(s.url + "/health", timeout=10).status_code == 200
        assert requests.get(s.url + "/metrics", timeout=10).status_code == 200
        for path in ("/get_server_info", "/v1/models"):
            assert requests.get(s.url + path, timeout=10).status_code == 401, (s.name, path)
            assert requests.get(s.url + path, headers=AUTH, timeout=10).status_code == 200, (s.name, path)
        r = requests.post(s.url + "/generate", json=greedy_body([5, 6], 2), timeout=10)
        assert r.status_code == 401, r.text
        # control routes take the admin key, not the inference key; without one, loopback peers
        assert requests.post(s.url + "/flush_cache", json={}, headers=AUTH, timeout=10).status_code == 200
    # a router without the key cannot use keyed servers: a clear 4xx/5xx error, not a hang
    bare = Router("rel-key-router-bare", [P], [D]).wait_ready()
    try:
        r = requests.post(bare.url + "/generate", json=greedy_body(prompt_ids(6, 3), 2), timeout=60)
        assert r.status_code >= 400 and "error" in r.json(), r.text
    finally:
        bare.stop()
    # and the keyed router still serves
    r = requests.post(R.url + "/generate", json=greedy_body(prompt_ids(6, 4), 3), headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text
