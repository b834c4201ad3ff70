"""Bad input, table-driven, over every public endpoint of the router, the prefill and decode servers,
the bootstrap server and the KV manager's control socket.

Each bad HTTP request gets a 4xx JSON error (the router owns the bootstrap fields, so bogus ones sent
to it are replaced and the request succeeds); bad control frames are dropped with a logged
rejection. No process dies, and a valid request through the router succeeds afterwards.
"""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import requests
from support.pd_stand import greedy_body, prompt_ids

pytestmark = pytest.mark.timeout(300)

GEN = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
COMP = {"model": "default", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0}


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def _with(base: dict, **kw) -> bytes:
    return _j({**base, **kw})


def _sp(**kw) -> bytes:
    return _j({**GEN, "sampling_params": {**GEN["sampling_params"], **kw}})


# (name, path, raw body) -- every one of these must be refused with a 4xx JSON error
COMMON = [
    ("truncated json", None, b'{"text": "hi"'),
    ("empty body", None, b""),
    ("json array", None, b"[1, 2, 3]"),
    ("json string", None, b'"hello"'),
    ("json null", None, b"null"),
    ("invalid utf-8", None, b'{"text": "\xff\xfe\xfd", "prompt": "\xff", "messages": "\xc3"}'),
    ("nan literal", None, b'{"text": NaN}'),
]
GENERATE = [
    ("text wrong type", _with(GEN, text=5)),
    ("sampling_params wrong type", _with(GEN, sampling_params="fast")),
    ("max_new_tokens string", _sp(max_new_tokens="ten")),
    ("max_new_tokens negative", _sp(max_new_tokens=-1)),
    ("max_new_tokens huge int", _sp(max_new_tokens=10**30)),
    ("temperature negative", _sp(temperature=-1.0)),
    ("top_p out of range", _sp(top_p=5.0)),
    ("top_k wrong type", _sp(top_k=[1])),
    ("float overflow", b'{"text": "hi", "sampling_params": {"temperature": 1e999}}'),
    ("unknown top-level field", _with(GEN, max_token=5)),
    ("unknown sampling field", _sp(max_tokenz=5)),
    ("input_ids out of vocab", _j({"input_ids": [10**9], "sampling_params": {"max_new_tokens": 2}})),
    ("input_ids negative", _j({"input_ids": [-1], "sampling_params": {"max_new_tokens": 2}})),
    ("input_ids empty", _j({"input_ids": [], "sampling_params": {"max_new_tokens": 2}})),
    ("input_ids nested junk", _j({"input_ids": [[[["x"]]]], "sampling_params": {"max_new_tokens": 2}})),
    ("text and input_ids both missing", _j({"sampling_params": {"max_new_tokens": 2}})),
    ("huge prompt string", _with(GEN, text="hello " * 40000)),
]
COMPLETIONS = [
    ("prompt wrong type", _with(COMP, prompt={"a": 1})),
    ("max_tokens negative", _with(COMP, max_tokens=-5)),
    ("n zero", _with(COMP, n=0)),
    ("n huge", _with(COMP, n=10**6)),
    ("logprobs huge", _with(COMP, logprobs=10**6)),
    ("stop wrong type", _with(COMP, stop=7)),
    ("unknown field", _with(COMP, max_token=5)),
]
CHAT_CASES = [
    ("messages not a list", _with(CHAT, messages="hi")),
    ("message role bogus", _with(CHAT, messages=[{"role": "wizard", "content": "hi"}])),
    ("message content int", _with(CHAT, messages=[{"role": "user", "content": 5}])),
    ("messages empty", _with(CHAT, messages=[])),
    ("temperature string", _with(CHAT, temperature="hot")),
    ("unknown field", _with(CHAT, max_token=5)),
]
BOOTSTRAP = [  # refused by prefill/decode servers; the router replaces them with its own
    ("room negative", _with(GEN, bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=-1)),
    ("room string", _with(GEN, bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room="abc")),
    ("room too big", _with(GEN, bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=2**64)),
    ("port out of range", _with(GEN, bootstrap_host="127.0.0.1", bootstrap_port=70000, bootstrap_room=1)),
    ("host wrong type", _with(GEN, bootstrap_host=123, bootstrap_port=8998, bootstrap_room=1)),
    ("room without host", _with(GEN, bootstrap_room=1)),
    ("host empty", _with(GEN, bootstrap_host="", bootstrap_port=8998, bootstrap_room=1)),
    ("host with a path", _with(GEN, bootstrap_host="127.0.0.1:1/x?", bootstrap_port=8998, bootstrap_room=1)),
    ("host list for one prompt", _with(GEN, bootstrap_host=["a", "b"], bootstrap_port=8998, bootstrap_room=1)),
    ("dp rank negative", _with(GEN, bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=1,
                               disagg_prefill_dp_rank=-3)),
]


def _inference_cases():
    for name, _, raw in COMMON:
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            yield f"{path} {name}", path, raw
    for name, raw in GENERATE:
        yield f"/generate {name}", "/generate", raw
    for name, raw in COMPLETIONS:
        yield f"/v1/completions {name}", "/v1/completions", raw
    for name, raw in CHAT_CASES:
        yield f"/v1/chat/completions {name}", "/v1/chat/completions", raw


def _assert_4xx_json(r: requests.Response, what: str) -> None:
    assert 400 <= r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"{what}: not JSON: {r.text[:300]}") from None
    assert "error" in body, f"{what}: {body}"


def _post(url: str, raw: bytes, timeout: float = 60) -> requests.Response:
    return requests.post(url, data=raw, headers={"Content-Type": "application/json"}, timeout=timeout)


def _alive(*procs) -> None:
    for p in procs:
        assert p.proc.poll() is None, f"{p.name} died:\n{p.log()}"


def _valid_request_works(router) -> None:
    r = requests.post(router.url + "/generate", json=greedy_body(prompt_ids(9, seed=1), 3), timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 3


def test_bad_inference_bodies_everywhere(pd11):
    P, D, R = pd11
    failures = []
    for name, path, raw in _inference_cases():
        for target in (R, P, D):
            try:
                _assert_4xx_json(_post(target.url + path, raw), f"{target.name} {name}")
            except AssertionError as e:
                failures.append(str(e))
    for name, raw in BOOTSTRAP:
        for target in (P, D):
            try:
                _assert_4xx_json(_post(target.url + "/generate", raw), f"{target.name} {name}")
            except AssertionError as e:
                failures.append(str(e))
        r = _post(R.url + "/generate", raw)  # the router owns these fields: replaced, then served
        if r.status_code != 200:
            failures.append(f"router {name}: {r.status_code} {r.text[:200]}")
    _alive(P, D, R)
    assert not failures, "\n".join(failures)
    _valid_request_works(R)
    P.wait_unleaked()
    D.wait_unleaked()


def test_oversized_body_is_413(pd11):
    P, D, R = pd11
    raw = _with(GEN, text="x" * (9 * 1024 * 1024))
    for target in (R, P):
        r = _post(target.url + "/generate", raw)
        assert r.status_code == 413, (target.name, r.status_code, r.text[:200])
        assert "error" in r.json()
    _alive(P, D, R)
    _valid_request_works(R)


def test_bad_control_requests(pd11):
    """/abort_request, GET endpoints with junk queries, and the router's /workers API."""
    P, D, R = pd11
    failures = []
    for target in (P, D):
        for raw in (b"{", b"[]", _j({"rid": 5}), _j({"rid": "x" * 100000}), b'{"rid": "\xff"}'):
            r = _post(target.url + "/abort_request", raw)
            if not (r.status_code < 500 and r.headers.get("Content-Type", "").startswith(("application/json", "text/plain"))):
                failures.append(f"{target.name} /abort_request {raw[:20]!r}: {r.status_code} {r.text[:200]}")
        for path in ("/get_server_info?dp_rank=abc", "/v1/models?x=%ff", "/get_model_info?" + "a" * 4000):
            r = requests.get(target.url + path, timeout=10)
            if r.status_code >= 500:
                failures.append(f"{target.name} GET {path[:40]}: {r.status_code}")
    worker_bodies = [
        b"{", b"[]", _j({"url": 5, "role": "prefill"}), _j({"url": "http://127.0.0.1:1", "role": "wizard"}),
        _j({"url": "http://127.0.0.1:1", "role": "prefill", "bootstrap_port": "x"}),
        _j({"url": "http://127.0.0.1:1", "role": "prefill", "bootstrap_port": 70000}),
        _j({"url": "not a url", "role": "decode"}), _j({"url": "ftp://127.0.0.1:1", "role": "decode"}),
        _j({"url": P.url, "role": "decode"}),  # conflicting: already registered as prefill
        b'{"url": "\xff", "role": "decode"}',
    ]
    for raw in worker_bodies:
        try:
            _assert_4xx_json(_post(R.url + "/workers", raw), f"POST /workers {raw[:40]!r}")
        except AssertionError as e:
            failures.append(str(e))
    r = requests.delete(R.url + "/workers/http%3A%2F%2Fnowhere%3A1", timeout=10)
    if r.status_code != 404:
        failures.append(f"DELETE unknown worker: {r.status_code} {r.text[:200]}")
    workers = requests.get(R.url + "/workers", timeout=10).json()
    assert [w["url"] for w in workers["prefill"]] == [P.url] and [w["url"] for w in workers["decode"]] == [D.url]
    _alive(P, D, R)
    assert not failures, "\n".join(failures)
    _valid_request_works(R)


def _bootstrap(P) -> str:
    return f"http://{P.host}:{P.bootstrap_port}"


def test_bad_bootstrap_registrations(pd11):
    P, D, R = pd11
    url = _bootstrap(P) + "/route"
    ranks = requests.get(url, timeout=10).json()["ranks"]
    good = ranks[0]
    bad = [
        b"{", b"[]", b"", b'{"dp_rank": "\xff"}',
        _j({**good, "dp_rank": "zero"}),
        _j({**good, "dp_rank": 99}),
        _j({**good, "tp_rank": -1}),
        _j({**good, "endpoint": "no-port"}),
        _j({**good, "endpoint": "127.0.0.1:0"}),
        _j({**good, "page_size": 0}),
        _j({**good, "kv_dtype": ""}),
        _j({**good, "surprise": 1}),  # unknown field
        _j({**good, "endpoint": "127.0.0.1:1"}),  # conflicting: rank 0 is already someone else
        _j({**good, "head_dim": 2**70}),
    ]
    failures = []
    for raw in bad:
        r = requests.put(url, data=raw, timeout=10)
        try:
            _assert_4xx_json(r, f"PUT /route {raw[:50]!r}")
        except AssertionError as e:
            failures.append(str(e))
    for q in ("?dp_rank=abc", "?dp_rank=99", "?tp_rank=" + "9" * 500):
        r = requests.get(url + q, timeout=10)
        if not 400 <= r.status_code < 500:
            failures.append(f"GET /route{q[:30]}: {r.status_code}")
    assert requests.get(url, timeout=10).json()["ranks"] == ranks, "a bad registration changed the topology"
    _alive(P, D, R)
    assert not failures, "\n".join(failures)
    _valid_request_works(R)


def test_garbage_control_frames_are_rejected_and_logged(pd11):
    import zmq

    from pdserve.kvtransfer import messages as m

    P, D, R = pd11
    endpoint = requests.get(_bootstrap(P) + "/route", timeout=10).json()["ranks"][0]["endpoint"]
    valid = m.encode(m.RoomRequest(room=1, decode_id="nobody", dst_pages=[1, 2], aux_slot=0))
    frames = [
        b"", b"\x00", b"\xff" * 64, valid[: len(valid) // 2], msgspec.msgpack.encode({"type": "Nope"}),
        msgspec.msgpack.encode([1, 2, 3]), bytes(range(256)) * 40,
        msgspec.msgpack.encode({"type": "RoomRequest", "room": "x", "decode_id": 1, "dst_pages": 0, "aux_slot": 0}),
        # well-formed but bogus: an unregistered decode, a pool that does not match, an endpoint that is no address
        valid,
        m.encode(m.RegisterPool("evil", "not-an-endpoint", "mooncake", b"junk",
                                m.LayoutInfo(1, 16, 1, 1, "float32"), -5, 0, [0], [0], 0, 0, 0)),
        m.encode(m.Heartbeat("evil", "also not an endpoint", 1)),
        m.encode(m.AbortRoom(room=12345, reason="x" * 100000)),
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://{endpoint}")
    for f in frames:
        sock.send(f)
    sock.close()
    ctx.term()
    time.sleep(1.0)
    log = P.log(200000)
    assert log.count("rejected bad control frame") >= 7, log[-3000:]
    assert "rejected decode evil" in log, log[-3000:]
    _alive(P, D, R)
    assert requests.get(P.url + "/health", timeout=5).status_code == 200
    _valid_request_works(R)
    P.wait_unleaked()
    D.wait_unleaked()


def test_client_gone_before_the_stream_headers_aborts_its_room(pd11):
    """A streamed request whose client vanishes at once (before the SSE headers go out) is aborted:
    its decode room does not sit on preallocated pages until the waiting timeout (120 s here)."""
    import socket

    from support.pd_stand import new_room

    P, D, R = pd11
    host, port = D.url.split("//")[1].split(":")
    for i in range(6):
        body = json.dumps({"input_ids": prompt_ids(200, seed=70 + i), "stream": True,
                           "sampling_params": {"max_new_tokens": 4},
                           # a room its prefill never hears of: only an abort frees its pages
                           "bootstrap_host": P.host, "bootstrap_port": P.bootstrap_port,
                           "bootstrap_room": new_room()}).encode()
        head = (f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(head + body)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    _alive(P, D, R)
    D.wait_unleaked(timeout=30)
    P.wait_unleaked(timeout=30)
