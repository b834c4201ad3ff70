"""Requests that would stall an engine server's event loop or its scheduler, against one real
server for the whole module: each is a 400 naming the field or the limit, the server answers
others meanwhile, and its pages are all free afterwards.

- Stop strings (count, length), prompts per batch, grammar text and a JSON schema's nesting are capped.
- A prompt whose characters cannot fit the context is refused before it is tokenized; one that is
  tokenized runs on the tokenizer's thread while the loop answers ``/health``.
- ``/health`` turns 503 while a stopped rank (SIGSTOP) holds a request, whose client gets a 504
  at ``--request-timeout``; once the rank runs on (SIGCONT) ``/health`` is 200 again and the
  aborted request's pages are free.
- A client that sends headers and then stalls its body gets a 408 at ``--http-read-timeout``.
- A client that sends its request head a byte at a time (slowloris) is closed at
  ``--http-header-timeout``; a connection over ``--max-connections`` is answered 503 naming the
  flag and closed, while the open ones are served on.
- A grammar that compiles for longer than ``--grammar-compile-timeout`` is a 400 naming it, and a
  plain request sent after it finishes first (the compile runs off the scheduler thread).
"""

from __future__ import annotations

import json
import os
import select
import socket
import signal
import threading
import time

import pytest
import requests
from server_helpers import ServerProcess, children_of

from pdserve.engine.frontend.grammar_fields import MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH
from pdserve.engine.frontend.tokenizer_manager import MAX_CHARS_PER_TOKEN
from pdserve.engine.frontend.value_checks import MAX_BATCH_PROMPTS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

pytestmark = pytest.mark.timeout(300)

COMPILE_TIMEOUT = 0.3
MAX_CONNECTIONS = 6
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
SMALL = {"max_new_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--grammar-compile-timeout", str(COMPILE_TIMEOUT), "--health-scheduler-timeout", "2",
                        "--request-timeout", "10", "--http-read-timeout", "2",
                        "--http-header-timeout", "4", "--max-connections", str(MAX_CONNECTIONS))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def error_of(r: requests.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def generate(server, body: dict) -> requests.Response:
    return server.post("/generate", body)


def deep_schema(depth: int) -> dict:
    """An object schema nested ``depth`` levels (short text, deep grammar)."""
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def test_stop_strings_batches_and_grammars_are_capped(server):
    err = error_of(generate(server, {"text": "x", "sampling_params": {**SMALL, "stop": ["s"] * (MAX_STOP_STRINGS + 1)}}))
    assert err["param"] == "stop" and str(MAX_STOP_STRINGS) in err["message"]
    err = error_of(generate(server, {"text": "x", "sampling_params": {**SMALL, "stop": "s" * (MAX_STOP_STRING_CHARS + 1)}}))
    assert err["param"] == "stop" and str(MAX_STOP_STRING_CHARS) in err["message"]
    err = error_of(server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["a"] * 100}))
    assert err["param"] == "stop"
    err = error_of(generate(server, {"text": ["x"] * (MAX_BATCH_PROMPTS + 1), "sampling_params": SMALL}))
    assert err["param"] == "text" and str(MAX_BATCH_PROMPTS) in err["message"]
    err = error_of(server.post("/v1/completions", {"prompt": [[1, 2]] * (MAX_BATCH_PROMPTS + 1), "max_tokens": 1}))
    assert err["param"] == "prompt"
    err = error_of(generate(server, {"text": "x", "sampling_params": {**SMALL, "regex": "a" * (MAX_GRAMMAR_CHARS + 1)}}))
    assert err["param"] == "sampling_params.regex" and str(MAX_GRAMMAR_CHARS) in err["message"]
    # deep, not long: 400 nested object schemas are 31 KiB, and xgrammar took 20 s to read them
    err = error_of(generate(server, {"text": "x", "sampling_params": {**SMALL, "json_schema": json.dumps(deep_schema(400))}}))
    assert err["param"] == "sampling_params.json_schema" and str(MAX_SCHEMA_DEPTH) in err["message"]
    err = error_of(server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(400)}}}))
    assert err["param"].startswith("response_format") and str(MAX_SCHEMA_DEPTH) in err["message"]
    # within the caps all is well
    r = generate(server, {"text": ["x", "y"], "sampling_params": {**SMALL, "stop": ["s"] * MAX_STOP_STRINGS}})
    assert r.status_code == 200 and len(r.json()) == 2
    server.wait_idle_and_unleaked()


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server):
    ctx = server.get("/get_model_info").json()["max_context_len"]
    err = error_of(generate(server, {"text": "a" * (ctx * MAX_CHARS_PER_TOKEN + 1), "sampling_params": SMALL}))
    assert err["param"] == "text" and err["code"] == "context_length_exceeded" and "characters" in err["message"]
    err = error_of(server.post("/tokenize", {"prompt": "a" * (ctx * MAX_CHARS_PER_TOKEN + 1)}))
    assert err["param"] == "prompt"


def test_tokenizing_a_long_prompt_leaves_the_loop_free(server):
    """A prompt under the character bound but over the context is tokenized (about a second),
    then refused; ``/health`` answers several times meanwhile."""
    ctx = server.get("/get_model_info").json()["max_context_len"]
    text = "one two three four five six " * (ctx * MAX_CHARS_PER_TOKEN // 28 - 1)
    done = threading.Event()
    out: dict = {}

    def big():
        out["r"] = generate(server, {"text": text, "sampling_params": SMALL})
        done.set()

    t = threading.Thread(target=big)
    t.start()
    answered_meanwhile = 0
    while not done.is_set():
        r = requests.get(server.url + "/health", timeout=30)
        if r.status_code == 200 and not done.is_set():
            answered_meanwhile += 1
    t.join()
    err = error_of(out["r"])
    assert err["code"] == "context_length_exceeded" and "tokens" in err["message"]
    assert answered_meanwhile >= 2


def bomb_schema() -> str:
    """A JSON schema of about 60 KiB (under the cap) that xgrammar takes seconds to compile."""
    props = {f"field_{i}_{'x' * 20}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 9 + 9}}}[0-9]+"}
             for i in range(480)}
    text = json.dumps({"type": "object", "properties": props, "required": list(props)})
    assert len(text) < MAX_GRAMMAR_CHARS
    return text


def test_a_slow_grammar_times_out_without_stalling_the_rank(server):
    out: dict = {}
    order: list[str] = []

    def bomb():
        out["bomb"] = generate(server, {"text": "x", "sampling_params": {**SMALL, "json_schema": bomb_schema()}})
        order.append("bomb")

    t = threading.Thread(target=bomb)
    t.start()
    time.sleep(0.3)  # the bomb reaches the rank first (not a bound: the order below is the check)
    plain = generate(server, {"text": "The capital of France is", "sampling_params": SMALL})
    order.append("plain")
    t.join()
    assert plain.status_code == 200, plain.text
    err = error_of(out["bomb"])
    assert err["message"].startswith("json_schema: the grammar did not compile within"), err
    assert order == ["plain", "bomb"]
    server.wait_idle_and_unleaked()


def test_health_fails_while_a_rank_with_work_does_not_step(server):
    ranks = [c for c in children_of(server.proc.pid) if "spawn_main" in open(f"/proc/{c}/cmdline").read()]
    assert len(ranks) == 1
    assert server.get("/health").status_code == 200
    out: dict = {}
    os.kill(ranks[0], signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: out.setdefault("r", generate(server, {"text": "Hi", "sampling_params": SMALL})))
        t.start()
        while (r := server.get("/health")).status_code == 200:
            time.sleep(0.2)
        assert r.status_code == 503 and "DP rank 0" in r.json()["error"]["message"], r.text
        t.join(120)  # the request waits on the stopped rank until its deadline
        assert out["r"].status_code == 504 and out["r"].json()["error"]["code"] == "request_timeout", out["r"].text
        assert server.get("/health").status_code == 503  # the rank still holds it
    finally:
        os.kill(ranks[0], signal.SIGCONT)
    while (r := server.get("/health")).status_code != 200:
        time.sleep(0.2)
    server.wait_idle_and_unleaked()


def test_a_stalled_body_is_answered_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"text\"")
        answer = s.recv(4096).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 408"), answer[:200]
    assert "http-read-timeout" in answer
    assert server.get("/health").status_code == 200


def read_answer(s: socket.socket) -> bytes:
    """One HTTP answer (head and Content-Length body), or what came before the connection closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next((line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0))
    while len(body) < length and (chunk := s.recv(4096)):
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_slowloris_connection_is_closed(server):
    """A request head sent a byte every 0.1 s never completes: the server closes the connection
    (at --http-header-timeout) before the last byte, without answering, and serves others."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 300 + b"\r\n\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        for byte in head:
            s.sendall(bytes([byte]))
            sent += 1
            if select.select([s], [], [], 0.1)[0]:
                break  # the server answered or closed
        try:
            answer = s.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert answer == b"" and sent < len(head), (sent, answer[:200])
    assert server.get("/health").status_code == 200


def test_connections_over_the_cap_are_refused(server):
    """With --max-connections keep-alive connections open, the next one is answered 503 naming the
    flag and closed; the open ones are still served, and once they close a new one is too."""
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
            held.append(s)
            s.sendall(HEALTH)
            assert read_answer(s).startswith(b"HTTP/1.1 200"), "a connection under the cap is served"
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as extra:
            answer = read_answer(extra)
            assert extra.recv(4096) == b""  # and closed
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        err = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert err["code"] == "too_many_connections" and f"--max-connections ({MAX_CONNECTIONS})" in err["message"]
        held[0].sendall(HEALTH)
        assert read_answer(held[0]).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    for _ in range(100):  # the server sees the closes as they arrive
        try:
            if server.get("/health").status_code == 200:
                break
        except requests.ConnectionError:  # refused while the closes were on their way
            pass
        time.sleep(0.1)
    else:
        pytest.fail("no connection served after the held ones closed")
