"""Real prefill and decode servers with an authenticated KV control plane, and their graceful drain.

- Greedy output with ``--disaggregation-auth-key-file`` equals the colocated server's (the output
  with auth off, as the other PD tests prove), over Mooncake and over NIXL; a bootstrap ``PUT
  /route`` without the key is refused and counted in the prefill server's ``/metrics``.
- A decode server sent SIGTERM with streams in flight finishes them with full outputs, answers new
  requests 503 with ``Retry-After``, fails ``/health`` with a draining body, and exits 0; so does a
  prefill server sent SIGTERM with a room in flight (its decode leg still gets the whole output).

SIGTERM goes to the server's main process only, as Kubernetes sends it to a container's PID 1.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import time

import pytest
import requests
from support.pd_stand import Server, greedy_body, new_room, pd_post, prompt_ids

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 6


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "kv.key"
    path.write_text("a shared secret of the KV control plane\n")
    return str(path)


def _pair(key_file: str, backend: str, name: str) -> tuple[Server, Server]:
    auth = ["--disaggregation-auth-key-file", key_file, "--max-total-tokens", "2048"]
    env = {"UCX_TLS": "tcp"} if backend == "nixl" else None
    return (Server(f"{name}-P", "prefill", *auth, backend=backend, env=env),
            Server(f"{name}-D", "decode", *auth, "--graceful-shutdown-timeout", "60", backend=backend, env=env))


@pytest.fixture(scope="module")
def mooncake(key_file, colocated):
    p, d = _pair(key_file, "mooncake", "auth-mc")
    try:
        yield p.wait_ready(), d.wait_ready()
    finally:
        p.stop()
        d.stop()


def _greedy_equals_colocated(p: Server, d: Server, reference) -> None:
    for n, seed in ((7, 1), (150, 2)):
        ids = prompt_ids(n, seed)
        pr, dr = pd_post(p, d, "/generate", greedy_body(ids, MAX_NEW))
        assert pr.status_code == 200, pr.text
        assert dr.status_code == 200, dr.text
        assert dr.json()["output_ids"] == reference(ids, MAX_NEW)


def test_mooncake_greedy_with_auth_equals_colocated_and_intruders_are_counted(mooncake, reference):
    p, d = mooncake
    _greedy_equals_colocated(p, d, reference)
    reg = {"dp_rank": 0, "tp_rank": 0, "endpoint": "127.0.0.1:1", "page_size": 16, "kv_dtype": "float32",
           "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "backend": "mooncake"}
    r = requests.put(f"http://{p.host}:{p.bootstrap_port}/route", json=reg, timeout=10)
    assert r.status_code == 401, r.text
    metrics = requests.get(p.url + "/metrics", timeout=10).text
    assert "pdserve_bootstrap_auth_refused_total 1.0" in metrics
    assert 'pdserve_kv_auth_refused_total{model_name=' in metrics
    d.wait_unleaked()
    p.wait_unleaked()


def test_nixl_greedy_with_auth_equals_colocated(key_file, colocated, reference):
    pytest.importorskip("nixl")
    p, d = _pair(key_file, "nixl", "auth-nixl")
    try:
        p.wait_ready()
        d.wait_ready()
        _greedy_equals_colocated(p, d, reference)
    finally:
        p.stop()
        d.stop()


def _stream(p: Server, d: Server, ids: list[int], max_new: int) -> tuple[int, list[int], str]:
    """A streamed PD request: (decode status, the last event's output ids, the finish reason)."""
    body = dict(greedy_body(ids, max_new), stream=True)
    _, r = pd_post(p, d, "/generate", body, timeout=300)
    assert not isinstance(r, Exception), r
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    last = events[-1] if events else {}
    return r.status_code, last.get("output_ids", []), json.dumps(last.get("meta_info", {}).get("finish_reason"))


def _check_draining(s: Server) -> None:
    h = requests.get(s.url + "/health", timeout=10)
    assert h.status_code == 503 and h.json()["status"] == "draining", h.text
    r = s.post("/generate", greedy_body([1, 2, 3], 2), timeout=30)
    assert r.status_code == 503 and r.headers.get("Retry-After"), (r.status_code, r.headers, r.text)
    assert "draining" in r.json()["error"]["message"]


def test_decode_drain_finishes_streams_in_flight(mooncake, reference):
    p, d = mooncake
    max_new, prompts = 48, [prompt_ids(20 + 10 * i, 10 + i) for i in range(4)]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(_stream, p, d, ids, max_new) for ids in prompts]
        deadline = time.monotonic() + 120
        while sum(s["num_running_reqs"] for s in d.states()) < len(prompts):
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.02)
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        _check_draining(d)
        for ids, fut in zip(prompts, futs):
            status, out, finish = fut.result(timeout=300)
            assert status == 200 and out == reference(ids, max_new), (finish, d.log())
    assert d.proc.wait(60) == 0, d.log()
    d.start()  # back for the prefill's drain test
    d.wait_ready()


def test_prefill_drain_finishes_a_room_in_flight(mooncake, reference):
    p, d = mooncake
    ids = prompt_ids(150, 99)
    room = new_room()
    body = dict(greedy_body(ids, MAX_NEW), bootstrap_host=p.host, bootstrap_port=p.bootstrap_port, bootstrap_room=room)
    with cf.ThreadPoolExecutor(2) as pool:
        p_leg = pool.submit(p.post, "/generate", body, 300)
        deadline = time.monotonic() + 60
        while sum(s["inflight"] for s in p.states()) < 1:  # the room waits for its decode here
            assert time.monotonic() < deadline, p.log()
            time.sleep(0.02)
        p.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        _check_draining(p)
        d_leg = pool.submit(d.post, "/generate", body, 300)  # the decode arrives after the SIGTERM
        pr, dr = p_leg.result(300), d_leg.result(300)
    assert pr.status_code == 200, pr.text
    assert dr.status_code == 200 and dr.json()["output_ids"] == reference(ids, MAX_NEW), dr.text
    assert p.proc.wait(60) == 0, p.log()
    d.wait_unleaked()
