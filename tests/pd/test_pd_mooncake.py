"""The disaggregated pipeline end to end over Mooncake (TCP): real servers, real transfers.

Stand: prefill servers PA (--dp-size 2) and PB, decode servers DA (--dp-size 2)
and DB (a small pool), all fp32 with 64-token chunks, and the colocated server
as the reference. PB and DB export OpenTelemetry traces to a receiver in this process.
Every scenario ends with the pools of the servers it used
proven unleaked (every page free after a cache flush, the ranks' idle
integrity checks passed).
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import sys
import time

import pytest
import requests
from support.pd_stand import InProcessRouter, Proc, Server, greedy_body, new_room, pd_post, prompt_ids, serving, sglang_router

from pdserve.entrypoints.procs import free_port, wait_healthy
from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(600)

# prompts from 1 token to beyond two 64-token chunks; max_new keeps generations short
LENGTHS = [1, 7, 64, 65, 150]
MAX_NEW = 6


@pytest.fixture(scope="module")
def stand(request, otlp):
    # PB and DB trace every request; their exporters send each batch after 0.1 s (the SDK's variable)
    trace = ("--enable-trace", "--otlp-traces-endpoint", otlp.endpoint)
    trace_env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    servers = {
        "PA": Server("PA", "prefill", "--dp-size", "2", "--max-total-tokens", "2048"),
        # rooms may wait long for DB's pages: a bootstrap timeout as generous as a real deployment's
        "PB": Server("PB", "prefill", "--max-total-tokens", "2048", "--disaggregation-bootstrap-timeout", "120",
                     *trace, env=trace_env),
        "DA": Server("DA", "decode", "--dp-size", "2", "--max-total-tokens", "2048"),
        # 48 pages: a few long requests exhaust it
        "DB": Server("DB", "decode", "--max-total-tokens", "768", "--num-reserved-decode-tokens", "16",
                     *trace, env=trace_env),
    }
    with serving(servers, lambda: request.getfixturevalue("colocated")):
        yield servers


def _check_pair(p, d, ref):
    assert not isinstance(p, Exception) and not isinstance(d, Exception), (p, d)
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    pj, dj = p.json(), d.json()
    assert pj["output_ids"] == ref[:1], "the prefill answers with the first token only"
    assert dj["output_ids"] == ref
    assert dj["meta_info"]["prompt_tokens"] == pj["meta_info"]["prompt_tokens"]


def test_1p1d_greedy_equals_colocated(stand, reference):
    P, D = stand["PB"], stand["DB"]
    for n in LENGTHS:
        ids = prompt_ids(n, seed=n)
        p, d = pd_post(P, D, "/generate", greedy_body(ids, MAX_NEW))
        _check_pair(p, d, reference(ids, MAX_NEW))
    P.wait_unleaked()
    D.wait_unleaked()


def test_topologies_2p1d_1p2d_and_dp_ranks(stand, reference):
    """2P1D (PA, PB -> DB), 1P2D (PB -> DA, DB), prefill dp2 (PA rank by body and by room), decode dp2 (DA)."""
    cases = []
    for i, n in enumerate([3, 70, 130, 20, 66, 1]):
        ids = prompt_ids(n, seed=100 + i)
        cases.append((ids, [
            ("PA", "DB", dict(prefill_dp_rank=i % 2)),  # 2P1D with PB below; prefill rank named in the body
            ("PB", "DB", {}),
            ("PB", "DA", dict(decode_dp_rank=i % 2)),  # 1P2D with DB above; decode rank named
            ("PA", "DA", {}),  # prefill rank from room % 2, decode rank least loaded
        ]))
    jobs = []
    with cf.ThreadPoolExecutor(8) as ex:
        for ids, legs in cases:
            for p, d, kw in legs:
                jobs.append((ids, ex.submit(pd_post, stand[p], stand[d], "/generate", greedy_body(ids, MAX_NEW), **kw)))
        for ids, fut in jobs:
            _check_pair(*fut.result(), reference(ids, MAX_NEW))
    for name in ("PA", "PB", "DA", "DB"):
        stand[name].wait_unleaked()
    # both ranks of each dp2 server served rooms
    for name in ("PA", "DA"):
        metrics = requests.get(stand[name].url + "/metrics", timeout=5).text
        for rank in (0, 1):
            line = next(x for x in metrics.splitlines()
                        if x.startswith("pdserve_requests_total{") and f'dp_rank="{rank}"' in x)
            assert float(line.split()[-1]) > 0, (name, line)


def test_openai_endpoints_and_streaming(stand, reference, colocated):
    P, D = stand["PB"], stand["DB"]
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    want = colocated.post("/v1/completions", body).json()["choices"][0]["text"]
    p, d = pd_post(P, D, "/v1/completions", body)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["choices"][0]["text"] == want
    chat = {"model": "default", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    want_chat = colocated.post("/v1/chat/completions", dict(chat, stream=False)).json()["choices"][0]["message"]["content"]
    p, d = pd_post(P, D, "/v1/chat/completions", chat)
    assert p.status_code == 200 and d.status_code == 200
    assert p.text.rstrip().endswith("data: [DONE]"), "a prefill asked for SSE answers with SSE"
    import json

    text = "".join(
        (json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        for line in d.text.splitlines() if line.startswith("data: {")
    )
    assert text == want_chat
    P.wait_unleaked()
    D.wait_unleaked()


def test_prefill_without_bootstrap_fields_is_400(stand):
    r = stand["PB"].post("/generate", greedy_body([1, 2, 3], 2))
    assert r.status_code == 400 and "bootstrap" in r.json()["error"]["message"]
    r = stand["DB"].post("/generate", greedy_body([1, 2, 3], 2))
    assert r.status_code == 400 and "bootstrap" in r.json()["error"]["message"]


def test_reused_bootstrap_room_is_400_first_unaffected(stand, reference):
    P, D = stand["PB"], stand["DB"]
    ids = prompt_ids(40, seed=7)
    room = new_room()
    body = dict(greedy_body(ids, MAX_NEW), bootstrap_host=P.host, bootstrap_port=P.bootstrap_port, bootstrap_room=room)
    with cf.ThreadPoolExecutor(2) as ex:
        first = ex.submit(P.post, "/generate", body)  # waits in the bootstrap queue: no decode leg yet
        time.sleep(0.5)
        second = P.post("/generate", body)
        assert second.status_code == 400, second.text
        assert "bootstrap_room" in second.json()["error"]["message"]
        d = D.post("/generate", body)
        p = first.result()
    _check_pair(p, d, reference(ids, MAX_NEW))
    P.wait_unleaked()
    D.wait_unleaked()


def test_decode_pages_exhausted_requests_wait_and_complete(stand, reference):
    """DB holds 48 pages; 8 requests of 200 prompt tokens need 13+ each: most wait in the prealloc queue."""
    P, D = stand["PB"], stand["DB"]
    prompts = [prompt_ids(200, seed=300 + i) for i in range(8)]
    with cf.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(pd_post, P, D, "/generate", greedy_body(ids, MAX_NEW)) for ids in prompts]
        for ids, fut in zip(prompts, futs):
            _check_pair(*fut.result(), reference(ids, MAX_NEW))
    P.wait_unleaked()
    D.wait_unleaked()


def test_client_disconnect_aborts_both_sides(stand):
    """The client leaves the decode leg while the prefill still computes a long prompt: the room fails on both."""
    P, D = stand["PB"], stand["DB"]
    ids = prompt_ids(600, seed=11)
    room = new_room()
    body = dict(greedy_body(ids, 50), bootstrap_host=P.host, bootstrap_port=P.bootstrap_port, bootstrap_room=room,
                stream=True)
    with cf.ThreadPoolExecutor(1) as ex:
        p = ex.submit(P.post, "/generate", dict(body, stream=False))
        try:
            D.post("/generate", body, timeout=0.3)
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
            pass  # the client gave up and closed its connection
        pr = p.result()
    assert pr.status_code == 500, pr.text
    assert "abort" in pr.json()["error"]["message"]
    P.wait_unleaked()
    D.wait_unleaked()


def test_pdserve_router_in_front_of_1p1d(stand, reference, colocated):
    P, D = stand["PB"], stand["DB"]
    port = free_port()
    router = Proc("router", [sys.executable, "-m", "pdserve.router", "--prefill", P.url, str(P.bootstrap_port),
                             "--decode", D.url, "--host", "127.0.0.1", "--port", str(port)])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", router.proc, 30, name="router", log=router.log)
        for n in (5, 90):
            ids = prompt_ids(n, seed=500 + n)
            r = requests.post(f"http://127.0.0.1:{port}/generate", json=greedy_body(ids, MAX_NEW), timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == reference(ids, MAX_NEW)
        body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        want = colocated.post("/v1/completions", body).json()["choices"][0]["text"]
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    finally:
        router.stop()
    P.wait_unleaked()
    D.wait_unleaked()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_one_trace_per_request_router_prefill_decode(stand, reference, otlp, stream):
    """A request with a client traceparent, through a tracing router to PB and DB: one trace,
    every span under the client's, each hop under the span of the hop before it."""
    P, D = stand["PB"], stand["DB"]
    rng = random.Random(int(stream))
    trace_id, client_span = f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64):016x}"
    r = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                     decode=(WorkerSpec(D.url, "decode"),), health_check_interval_secs=3600,
                                     enable_trace=True, otlp_traces_endpoint=otlp.endpoint))
    ids = prompt_ids(90, seed=620)
    try:
        r.wait_ready()
        resp = requests.post(f"http://127.0.0.1:{r.port}/generate", json=dict(greedy_body(ids, MAX_NEW), stream=stream),
                             headers={"traceparent": f"00-{trace_id}-{client_span}-01"}, timeout=120)
        assert resp.status_code == 200, resp.text
        if not stream:
            assert resp.json()["output_ids"] == reference(ids, MAX_NEW)
    finally:
        r.close()  # exports the router's spans
    server_stages = {"server.request", "tokenize", "prefill.queue_prefill_kv_transfer", "decode.kv_transfer_wait",
                     "decode"}
    spans = otlp.wait_for(trace_id, {"router.request", "router.queue", "router.route", "router.leg.prefill",
                                     "router.leg.decode"} | server_stages)
    one = {}
    for s in spans:
        one.setdefault((s.service, s.name), []).append(s)
    # no retry: one span of each per process (but the rank's per-chunk and per-step spans)
    assert all(len(v) == 1 for k, v in one.items() if k[1] not in ("prefill.chunk", "decode.step")), one
    assert len(one["pdserve-prefill", "prefill.chunk"]) == 2  # 90 tokens in 64-token chunks
    by = {k: v[0] for k, v in one.items()}
    root = by["pdserve-router", "router.request"]
    assert root.parent_span_id == client_span
    for name in ("router.queue", "router.route", "router.leg.prefill", "router.leg.decode"):
        assert by["pdserve-router", name].parent_span_id == root.span_id, name
    route = by["pdserve-router", "router.route"].attributes
    assert P.url in route["pdserve.prefill"] and D.url in route["pdserve.decode"], route
    for role in ("prefill", "decode"):
        server = by[f"pdserve-{role}", "server.request"]
        assert server.parent_span_id == by["pdserve-router", f"router.leg.{role}"].span_id, role
        assert server.attributes["http.status_code"] == 200
        assert by[f"pdserve-{role}", "tokenize"].parent_span_id == server.span_id
    first = {"prefill": "prefill.queue_prefill_kv_transfer", "decode": "decode.kv_transfer_wait"}
    for role, name in first.items():
        assert by[f"pdserve-{role}", name].parent_span_id == by[f"pdserve-{role}", "server.request"].span_id
        assert by[f"pdserve-{role}", name].attributes["pdserve.prompt_tokens"] == len(ids)
    assert by["pdserve-decode", "decode"].attributes["pdserve.completion_tokens"] == MAX_NEW
    assert {s.service for s in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    P.wait_unleaked()
    D.wait_unleaked()


def test_sglang_router_drives_pdserve_servers(stand, reference, colocated):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    P, D = stand["PB"], stand["DB"]
    with sglang_router("sglang-router", P, D) as url:
        ids = prompt_ids(70, seed=900)
        r = requests.post(f"{url}/generate", json=greedy_body(ids, MAX_NEW), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == reference(ids, MAX_NEW)
        body = {"model": "default", "messages": [{"role": "user", "content": "Name a color"}], "max_tokens": 6,
                "temperature": 0}
        want = colocated.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
        r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        # n > 1: its one room, numbered per choice by the servers as SGLang's number it
        body = N_BODIES["/v1/completions"]
        want = _choices("/v1/completions", colocated.post("/v1/completions", body), False)
        assert _choices("/v1/completions", requests.post(f"{url}/v1/completions", json=body, timeout=120),
                        False) == want
    P.wait_unleaked()
    D.wait_unleaked()


def test_prefill_sigkill_fails_rooms_within_heartbeat_then_recovers(stand, reference):
    """SIGKILL PB while rooms wait on it: DB ends them with a clear error within the heartbeat window
    (1 s x 3); once PB is back on the same ports, new requests succeed."""
    P, D = stand["PB"], stand["DB"]
    prompts = [prompt_ids(600, seed=40 + i) for i in range(3)]
    with cf.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(pd_post, P, D, "/generate", greedy_body(ids, 20)) for ids in prompts]
        time.sleep(1.0)  # rooms bootstrapped, prefill computing the first 600-token prompt
        P.kill()
        results = [f.result() for f in futs]
    decode_errors = [d for _, d in results if d.status_code != 200]
    assert decode_errors, "at least one room was still waiting on the killed prefill"
    for d in decode_errors:
        assert d.status_code == 500
        msg = d.json()["error"]["message"]
        assert "KV transfer failed" in msg and "unreachable" in msg, msg  # ended by the heartbeat
    D.wait_unleaked()
    P.start()
    P.wait_ready()
    ids = prompt_ids(33, seed=41)
    deadline = time.monotonic() + 30
    while True:  # the decode side re-resolves the restarted prefill
        p, d = pd_post(P, D, "/generate", greedy_body(ids, MAX_NEW))
        if d.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    _check_pair(p, d, reference(ids, MAX_NEW))
    P.wait_unleaked()
    D.wait_unleaked()


# -- n > 1 through a router: every expanded sequence has a room of its own ----------------------

N = 3
N_BODIES = {
    "/generate": {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                         "n": N}},
    "/v1/completions": {"model": "default", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
                        "n": N},
    "/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "Name a fruit"}],
                             "max_tokens": 5, "temperature": 0, "n": N},
}


def _choices(path: str, r: requests.Response, stream: bool) -> list[str]:
    """The text of each choice, by index, from a JSON answer or an SSE stream."""
    import json

    assert r.status_code == 200, r.text
    if not stream:
        j = r.json()
        if path == "/generate":
            return [c["text"] for c in j]
        key = "text" if path == "/v1/completions" else "message"
        return [c[key] if key == "text" else c[key]["content"] for c in sorted(j["choices"], key=lambda c: c["index"])]
    assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    out: dict[int, str] = {}
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        if path == "/generate":
            out[ev["index"]] = ev["text"]  # whole text so far
            continue
        for c in ev["choices"]:
            piece = c.get("text") if path == "/v1/completions" else (c.get("delta") or {}).get("content")
            out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return [out[i] for i in sorted(out)]


@pytest.fixture(scope="module")
def n_router(stand):
    from support.pd_stand import InProcessRouter

    from pdserve.router.config import RouterConfig, WorkerSpec

    P, D = stand["PB"], stand["DB"]
    r = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                     decode=(WorkerSpec(D.url, "decode"),), health_check_interval_secs=3600,
                                     policy="round_robin"))
    try:
        r.wait_ready()
        yield f"http://127.0.0.1:{r.port}"
    finally:
        r.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_n_choices_through_the_router_equal_colocated(stand, colocated, n_router, stream):
    """Before, every choice reused the request's room and the servers answered 400 'bootstrap_room ...
    is already in flight'."""
    for path, body in N_BODIES.items():
        want = _choices(path, colocated.post(path, body), False)
        assert len(want) == N
        r = requests.post(n_router + path, json=dict(body, stream=stream), timeout=120)
        assert _choices(path, r, stream) == want, path
    stand["PB"].wait_unleaked()
    stand["DB"].wait_unleaked()


def test_n_choices_of_a_batch_and_over_dp_ranks(stand, colocated):
    """A batch of two prompts with n = 2 (the router's list of rooms), over a prefill and a decode
    server of 2 DP ranks each: each sequence's room places it on both sides alike."""
    from support.pd_stand import InProcessRouter

    from pdserve.router.config import RouterConfig, WorkerSpec

    P, D = stand["PA"], stand["DA"]
    body = {"text": ["The sky is", "Water boils at"], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2}}
    want = [c["text"] for c in colocated.post("/generate", body).json()]
    r = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                     decode=(WorkerSpec(D.url, "decode"),), health_check_interval_secs=3600))
    try:
        r.wait_ready()
        got = requests.post(f"http://127.0.0.1:{r.port}/generate", json=body, timeout=120)
        assert got.status_code == 200, got.text
        assert len(want) == 4 and [c["text"] for c in got.json()] == want
        one = dict(N_BODIES["/v1/completions"], n=4)
        want = _choices("/v1/completions", colocated.post("/v1/completions", one), False)
        got = requests.post(f"http://127.0.0.1:{r.port}/v1/completions", json=one, timeout=120)
        assert _choices("/v1/completions", got, False) == want
    finally:
        r.close()
    P.wait_unleaked()
    D.wait_unleaked()


def test_a_client_leaving_an_n_stream_frees_both_pools(stand, n_router):
    P, D = stand["PB"], stand["DB"]
    body = {"model": "default", "prompt": "Tell a long story", "max_tokens": 400, "temperature": 0, "n": 4,
            "ignore_eos": True, "stream": True}
    with requests.post(n_router + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: {"))
    # the connection is closed mid-stream: every choice's room ends on both sides
    P.wait_unleaked(60)
    D.wait_unleaked(60)


def test_sequence_rooms_follow_sglangs_numbering():
    from pdserve.engine.pd_rules import ROOM_SPACE, sequence_room

    r = 1000
    # one int: sequence k of SGLang's expanded order (k = choice * prompts + prompt) has room r + k
    assert [sequence_room(r, i, j, 2) for j in range(3) for i in range(2)] == [r + k for k in range(6)]
    rooms = [7, 99]
    assert [sequence_room(rooms, i, j, 2) for i in range(2) for j in range(2)] == [7, 9, 99, 101]
    assert sequence_room(ROOM_SPACE - 1, 0, 2, 1) == 1  # wraps below 2^63


def test_decode_killed_prefill_frees_rooms(stand):
    """SIGKILL DA while its rooms are open on PA: PA answers every room with an error within its
    bootstrap timeout (4 s) or at the failed write, and frees their pages. Last in this file: DA stays dead."""
    P, D = stand["PA"], stand["DA"]
    prompts = [prompt_ids(600, seed=60 + i) for i in range(3)]
    with cf.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(pd_post, P, D, "/generate", greedy_body(ids, 20)) for ids in prompts]
        time.sleep(1.0)
        D.kill()
        results = [f.result() for f in futs]
    prefill_answers = [p for p, _ in results]
    assert all(not isinstance(p, Exception) for p in prefill_answers), prefill_answers
    failed = [p for p in prefill_answers if p.status_code != 200]
    assert failed, "at least one room was open when the decode died"
    for p in failed:
        assert "KV transfer failed" in p.json()["error"]["message"], p.text
    P.wait_unleaked()
