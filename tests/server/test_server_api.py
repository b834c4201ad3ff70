"""The engine server over HTTP: one real server (DP=1, with an API key) for the whole module.

Greedy outputs are compared with the offline Engine's; the last test kills the
scheduler rank and checks that the server fails loudly and exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time

import aiohttp
import openai
import pytest
import requests
from server_helpers import ServerProcess, chat_ids, children_of, greedy_ref, is_running

pytestmark = pytest.mark.timeout(300)

API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"
MAX_REQUEST_BYTES = 100_000
MAX_N = 3
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_NEW = 10


@pytest.fixture(scope="module")
def started_server():
    srv = ServerProcess("--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-n", str(MAX_N), api_key=API_KEY,
                        admin_key=ADMIN_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(started_server, engine):
    # the server loads its model while this process loads the reference engine's
    return started_server.wait_ready()


@pytest.fixture(scope="module")
def refs(engine):
    """Greedy reference outputs of the offline Engine, per prompt."""
    return {p: greedy_ref(engine, engine.tokenizer.encode(p), MAX_NEW) for p in PROMPTS}


def _sse_events(resp: requests.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


# --- outputs equal the offline engine's --------------------------------------------------------


def test_generate_matches_offline_engine(server, engine, refs):
    for p in PROMPTS:
        ref = refs[p]
        r = server.post("/generate", {"text": p, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == ref["output_ids"]
        assert out["text"] == ref["text"]
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(engine.tokenizer.encode(p))
        assert meta["completion_tokens"] == len(ref["output_ids"])
        assert meta["finish_reason"]["type"] == ref["meta_info"]["finish_reason"]["type"]
        assert meta["e2e_latency"] > 0 and "cached_tokens" in meta

    # input_ids, as a batch, streamed: the text so far in each event, then [DONE]
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    r = server.post(
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, "stream": True},
        stream=True,
    )
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = _sse_events(r)
    assert events[-1] == "[DONE]"
    final = {}
    for ev in events[:-1]:
        prev = final.get(ev["index"])
        if prev is not None:  # cumulative: every event extends the previous one
            assert ev["text"].startswith(prev["text"]) and ev["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        final[ev["index"]] = ev
    for i, p in enumerate(PROMPTS[:2]):
        assert final[i]["text"] == refs[p]["text"]
        assert final[i]["output_ids"] == refs[p]["output_ids"]
        assert final[i]["meta_info"]["finish_reason"] is not None


def test_openai_completions_match_offline_engine(server, refs):
    client = _client(server)
    p = PROMPTS[0]
    c = client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=MAX_NEW, temperature=0)
    assert c.choices[0].text == refs[p]["text"]
    assert c.usage.completion_tokens == len(refs[p]["output_ids"])
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=p, max_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == refs[p]["text"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(refs[p]["output_ids"])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")


def test_openai_chat_matches_offline_engine(server, engine):
    client = _client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = greedy_ref(engine, chat_ids(engine.tokenizer, messages), MAX_NEW)
    c = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=MAX_NEW, temperature=0
    )
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == ref["text"]
    assert c.usage.prompt_tokens == len(chat_ids(engine.tokenizer, messages))
    assert c.usage.completion_tokens == len(ref["output_ids"])
    # streamed, another question: the same one again would be all a prefix-cache hit, its logits
    # from a one-token extend step (gemv) where the reference prefilled whole, and this answer's
    # first token is a bf16 near-tie that such a difference can reverse (it did on Emerald Rapids)
    messages = [{"role": "user", "content": "What is the capital of Italy?"}]
    ref = greedy_ref(engine, chat_ids(engine.tokenizer, messages), MAX_NEW)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_completion_tokens=MAX_NEW, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": 1, "separate_reasoning": True, "no_stop_trim": False},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref["text"]
    assert chunks[-1].usage.completion_tokens == len(ref["output_ids"])


def test_return_token_ids(server, engine, refs):
    """vLLM's ``return_token_ids`` (the router's migration reads them): each streamed chunk's new ids,
    the prompt's ids once; a whole completion's ids on its choice."""
    messages = [{"role": "user", "content": "What is the capital of Spain?"}]
    ref = greedy_ref(engine, chat_ids(engine.tokenizer, messages), MAX_NEW)
    body = {"messages": messages, "max_tokens": MAX_NEW, "temperature": 0, "stream": True, "return_token_ids": True}
    r = requests.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, stream=True, timeout=120)
    chunks = [e for e in _sse_events(r) if e != "[DONE]"]
    assert chunks[0]["prompt_token_ids"] == chat_ids(engine.tokenizer, messages)
    assert not any("prompt_token_ids" in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ref["output_ids"]
    p = PROMPTS[0]
    body = {"prompt": p, "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True}
    out = requests.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120).json()
    assert out["choices"][0]["token_ids"] == refs[p]["output_ids"]
    assert out["choices"][0]["prompt_token_ids"] == engine.tokenizer.encode(p)


def test_concurrent_streams_complete_with_usage(server, engine):
    n_req, max_tokens = 32, 6
    prompts = [f"Count to {i}:" for i in range(n_req)]

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, int, str]:
        body = {
            "model": "SmolLM2-135M-Instruct", "prompt": prompts[i], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True},
        }
        usage, text, done = None, "", False
        async with session.post(server.url + "/v1/completions", json=body, headers=server.headers) as resp:
            assert resp.status == 200
            async for line in resp.content:
                line = line.strip()
                if not line:
                    continue
                payload = line[len(b"data: ") :]
                if payload == b"[DONE]":
                    done = True
                    continue
                ev = json.loads(payload)
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev["choices"]:
                    text += ch["text"]
        assert done and usage is not None
        return usage["prompt_tokens"], usage["completion_tokens"], text

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=200)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(n_req)))

    results = asyncio.run(main())
    for i, (prompt_tokens, completion_tokens, text) in enumerate(results):
        assert prompt_tokens == len(engine.tokenizer.encode(prompts[i]))
        assert completion_tokens == max_tokens
        assert text
    server.wait_idle_and_unleaked()


def test_n_choices_and_logprobs(server):
    r = server.post(
        "/v1/completions",
        {"prompt": PROMPTS[0], "max_tokens": 4, "n": 2, "temperature": 0.8, "seed": 7, "logprobs": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    for c in body["choices"]:
        assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"]) >= 1
        assert all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])
        assert all(len(t) <= 2 for t in c["logprobs"]["top_logprobs"])
    # usage counts the prompt once, the completions of both choices
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in body["choices"])
    r = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1 and len(content[0]["top_logprobs"]) == 2
    r = server.post(
        "/generate",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True, "top_logprobs_num": 2,
         "return_text_in_logprobs": True},
    )
    meta = r.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert isinstance(meta["output_token_logprobs"][0][2], str)


# --- bad input ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
GEN = "/generate"
MSG = [{"role": "user", "content": "Hi"}]
LONG_TEXT = "hello " * 9000  # > 8192 tokens of context

BAD_INPUTS = [
    # (endpoint, raw body or JSON, status, param named)
    (CHAT, b"{not json", 400, None),
    (COMP, b"{not json", 400, None),
    (GEN, b"{not json", 400, None),
    (CHAT, {"messages": MSG, "max_token": 5}, 400, "max_token"),
    (COMP, {"prompt": "Hi", "max_token": 5}, 400, "max_token"),
    (GEN, {"text": "Hi", "sampling_params": {"max_new_token": 5}}, 400, "sampling_params.max_new_token"),
    (GEN, {"text": "Hi", "max_token": 5}, 400, "max_token"),
    (CHAT, {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens"),
    (COMP, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    (GEN, {"text": 5}, 400, "text"),
    (CHAT, {"messages": "Hi"}, 400, "messages"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    (COMP, {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    (GEN, {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, 400, "sampling_params.max_new_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10**7}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**7}, 400, "max_completion_tokens"),
    (COMP, {"prompt": "Hi", "max_tokens": 10**7}, 400, "max_tokens"),
    (GEN, {"text": "Hi", "sampling_params": {"max_new_tokens": 10**7}}, 400, "sampling_params.max_new_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages"),
    (COMP, {"prompt": LONG_TEXT}, 400, "prompt"),
    (GEN, {"text": LONG_TEXT}, 400, "text"),
    (CHAT, {"messages": []}, 400, "messages"),
    (COMP, {"prompt": ""}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (GEN, {"text": ""}, 400, "text"),
    (GEN, {"input_ids": []}, 400, "input_ids"),
    (GEN, {"input_ids": [1, 10**9]}, 400, "input_ids"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 400, "model"),
    (COMP, {"prompt": "Hi", "model": "gpt-4"}, 400, "model"),
    (GEN, {"text": "Hi", "model": "gpt-4"}, 400, "model"),
    (CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
    (COMP, {"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    (GEN, {"text": "Hi", "sampling_params": {"temperature": -0.5}}, 400, "sampling_params.temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    (GEN, {"text": "Hi", "sampling_params": {"top_p": 0}}, 400, "sampling_params.top_p"),
    (CHAT, {"messages": MSG, "n": MAX_N + 1}, 400, "n"),
    (COMP, {"prompt": "Hi", "n": MAX_N + 1}, 400, "n"),
    (GEN, {"text": "Hi", "sampling_params": {"n": MAX_N + 1}}, 400, "sampling_params.n"),
    (CHAT, {"messages": MSG, "routed_dp_rank": 1}, 400, "routed_dp_rank"),
    (GEN, {"text": "Hi", "routed_dp_rank": -1}, 400, "routed_dp_rank"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]}, 413, None),
    (COMP, {"prompt": "x" * MAX_REQUEST_BYTES}, 413, None),
    (GEN, {"text": "x" * MAX_REQUEST_BYTES}, 413, None),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_INPUTS)
def test_bad_input(server, endpoint, body, status, param):
    if isinstance(body, bytes):
        r = requests.post(server.url + endpoint, data=body, headers=server.headers, timeout=30)
    else:
        r = server.post(endpoint, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    assert err["param"] == param
    if param is not None:
        assert param.split(".")[-1] in err["message"]


def test_server_keeps_serving_after_bad_input_and_leaks_no_pages(server):
    r = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    server.wait_idle_and_unleaked()


def test_sglang_router_extras_accepted(server):
    """The optional fields SGLang's router adds are accepted, never rejected."""
    r = server.post(
        CHAT,
        {"messages": MSG, "max_tokens": 2, "max_completion_tokens": 2, "logprobs": False, "no_stop_trim": False,
         "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
         "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False},
    )
    assert r.status_code == 200, r.text
    r = server.post(
        COMP,
        {"prompt": "Hi", "max_tokens": 2, "echo": False, "no_stop_trim": False, "ignore_eos": False,
         "skip_special_tokens": True, "return_hidden_states": False},
    )
    assert r.status_code == 200, r.text
    r = server.post(
        GEN,
        {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "model": None, "return_text_in_logprobs": False,
         "log_metrics": True, "return_hidden_states": False, "background": False, "no_logs": False,
         "return_bytes": False, "return_entropy": False},
    )
    assert r.status_code == 200, r.text


# --- auth, info, control ------------------------------------------------------------------------


def test_api_key(server):
    for method, path in [("post", GEN), ("post", COMP), ("post", CHAT), ("get", "/v1/models"),
                         ("get", "/get_server_info"), ("get", "/health_generate")]:
        r = getattr(requests, method)(server.url + path, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        r = getattr(requests, method)(server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert requests.get(server.url + "/metrics", timeout=10).status_code == 200


def test_control_routes_take_the_admin_key_alone(server):
    """The inference key never opens a control route; the admin key (from its file) does, and it
    opens no inference route."""
    for headers in ({}, server.headers, {"Authorization": "Bearer wrong"}):
        r = requests.post(server.url + "/flush_cache", json={}, headers=headers, timeout=10)
        assert r.status_code == 401, r.text
        assert "--admin-api-key" in r.json()["error"]["message"]
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert requests.post(server.url + "/flush_cache", json={}, headers=admin, timeout=10).status_code == 200
    assert requests.get(server.url + "/v1/models", headers=admin, timeout=10).status_code == 401
    assert "admin_api_key" not in server.server_info()


def test_info_endpoints(server):
    models = server.get("/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    for path in ("/get_model_info", "/model_info"):
        info = server.get(path).json()
        assert info["is_generation"] is True and info["model_path"]
    for path in ("/get_server_info", "/server_info"):
        info = server.get(path).json()
        assert info["dp_size"] == 1 and info["disaggregation_mode"] == "null"
        assert info["page_size"] == 16 and info["max_total_num_tokens"] > 0 and info["version"]
        assert "api_key" not in info
    assert server.get("/health_generate").status_code == 200
    resp = server.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = resp.text
    for name in ("pdserve_requests_total", "pdserve_num_running_reqs", "pdserve_num_waiting_reqs",
                 "pdserve_kv_usage", "pdserve_prompt_tokens_total", "pdserve_generation_tokens_total",
                 "pdserve_time_to_first_token_seconds_bucket", "pdserve_time_per_output_token_seconds_bucket",
                 "pdserve_e2e_request_latency_seconds_bucket"):
        assert name in text, name
    generated = [l for l in text.splitlines() if l.startswith("pdserve_generation_tokens_total")]
    assert float(generated[0].split()[-1]) > 0
    r = server.get("/no_such_path")
    assert r.status_code == 404 and "error" in r.json()


def test_abort_request(server):
    rid = "abort-me"

    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"text": "Tell me a story", "rid": rid, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
            task = asyncio.ensure_future(session.post(server.url + GEN, json=body, headers=server.headers))
            await asyncio.sleep(1.0)
            async with session.post(server.url + "/abort_request", json={"rid": rid}, headers=server.headers) as r:
                assert r.status == 200
                assert (await r.json())["aborted"] == 1
            resp = await asyncio.wait_for(task, 30)
            return await resp.json()

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 2000
    server.wait_idle_and_unleaked()


def _open_request(server, path: str, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw
    )
    return sock


def _aborted_count(server) -> float:
    m = re.search(r'^pdserve_requests_finished_total\{[^}]*reason="abort"\} (\S+)$', server.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_client_disconnect_mid_stream_frees_pages(server):
    aborted = _aborted_count(server)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Tell me a long story", "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    sock = _open_request(server, "/v1/completions", body)
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    # a rank's state is published every STATS_INTERVAL (50 ms) while busy, and 3 tokens can
    # stream out sooner than that: wait for a state taken while the request runs
    deadline = time.monotonic() + 5
    while True:
        running = server.server_info()["internal_states"][0]
        if running["num_free_pages"] < running["num_total_pages"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert running["inflight"] == 1 and running["num_free_pages"] < running["num_total_pages"]
    sock.close()
    states = server.wait_idle_and_unleaked(timeout=15)
    assert states[0]["inflight"] == 0
    assert _aborted_count(server) == aborted + 1


def test_client_disconnect_before_a_non_streamed_answer_aborts(server):
    aborted = _aborted_count(server)
    body = {"text": "Tell me a long story", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    sock = _open_request(server, "/generate", body)
    deadline = time.monotonic() + 30
    while server.server_info()["internal_states"][0]["inflight"] != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    sock.close()
    server.wait_idle_and_unleaked(timeout=15)
    assert _aborted_count(server) == aborted + 1


# --- last: a dead scheduler rank -----------------------------------------------------------------


def test_dead_rank_fails_requests_and_server_exits(server):
    ranks = [c for c in children_of(server.proc.pid) if "spawn_main" in open(f"/proc/{c}/cmdline").read()]
    assert len(ranks) == 1
    r = server.post(COMP, {"prompt": "Tell me a story", "max_tokens": 3000, "ignore_eos": True, "stream": True},
                    stream=True)
    assert r.status_code == 200
    lines = r.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))
    os.kill(ranks[0], signal.SIGKILL)
    rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"
    err = json.loads(rest[-2][len(b"data: ") :])
    assert "error" in err and "exited" in err["error"]["message"]
    health = requests.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
    # the server exits non-zero instead of hanging, and leaves no child behind
    assert server.proc.wait(15) == 1
    assert not any(is_running(c) for c in ranks)
