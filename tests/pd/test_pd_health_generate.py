"""One prefill server, one decode server and the router (Mooncake over TCP): ``/health_generate``
really generates on every process (the PD servers run the probe locally, without a KV peer), and
is 503 once a rank is dead; every process answers an unknown path with a JSON 404 and a wrong
method with a JSON 405; an unsupported field is a 400 naming it through the router too."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import requests
from support.pd_stand import InProcessRouter, Server, greedy_body, prompt_ids

from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(600)


def rank_pids(server: Server) -> list[int]:
    """The scheduler rank processes of a server (its multiprocessing children)."""
    pids = []
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
                pids.append(int(pid))
    return pids


@pytest.fixture(scope="module")
def stand():
    P = Server("hgP", "prefill", "--max-total-tokens", "2048")
    D = Server("hgD", "decode", "--max-total-tokens", "2048")
    router = None
    try:
        P.wait_ready()
        D.wait_ready()
        router = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                              decode=(WorkerSpec(D.url, "decode"),),
                                              health_check_interval_secs=3600))
        yield P, D, f"http://127.0.0.1:{router.port}"
    finally:
        if router is not None:
            router.close()
        P.stop()
        D.stop()


def test_health_generate_is_200_on_prefill_decode_and_router(stand):
    P, D, router = stand
    for url in (P.url, D.url, router):
        r = requests.get(url + "/health_generate", timeout=60)
        assert r.status_code == 200, (url, r.text)
    # the probes held no room and left no page behind; real PD requests still flow
    for server in (P, D):
        server.wait_unleaked()
    r = requests.post(router + "/generate", json=greedy_body(prompt_ids(20, 1), 3), timeout=120)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


def test_every_process_answers_unknown_paths_and_wrong_methods_in_json(stand):
    P, D, router = stand
    bootstrap = f"http://127.0.0.1:{P.bootstrap_port}"
    for base in (P.url, D.url, router, bootstrap):
        for method, path, status in (("GET", "/no/such/path", 404), ("POST", "/v1/nothing", 404),
                                     ("DELETE", "/health", 405)):
            r = requests.request(method, base + path, timeout=10)
            assert r.status_code == status and r.headers["Content-Type"].startswith("application/json"), \
                (base, method, path, r.status_code, r.text)
            assert path in str(r.json()["error"]), r.text
    for base in (P.url, D.url, router):  # a GET on a POST-only endpoint
        r = requests.get(base + "/generate", timeout=10)
        assert r.status_code == 405 and "error" in r.json()


def test_unsupported_fields_are_refused_through_the_router(stand):
    _, _, router = stand
    for path, body, param in (
        ("/generate", {"text": "Hi", "lora_path": "my-adapter"}, "lora_path"),
        ("/v1/completions", {"prompt": "Hi", "priority": 2}, "priority"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "custom_logit_processor": "{}"}, "custom_logit_processor"),
    ):
        r = requests.post(router + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param or param in r.json()["error"]["message"], r.text


def test_tokenize_and_detokenize_through_the_router(stand):
    _, D, router = stand
    r = requests.post(router + "/tokenize", json={"prompt": "Hello world"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 8192
    r = requests.post(D.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert r.json()["text"] == "Hello world"


def test_health_generate_is_503_once_a_rank_is_dead(stand):
    """Last in this module: it kills the decode server's rank."""
    P, D, router = stand
    (rank,) = rank_pids(D)
    os.kill(rank, signal.SIGKILL)
    r = requests.get(D.url + "/health_generate", timeout=60)
    assert r.status_code == 503, r.text
    r = requests.get(router + "/health_generate", timeout=60)
    assert r.status_code == 503 and D.url in r.json()["message"], r.text
    assert requests.get(P.url + "/health_generate", timeout=60).status_code == 200
