"""Conditional disaggregation end to end (Mooncake over TCP): the router sends short prompts to the
decode worker alone, which prefills them itself; longer ones, and ones above the decode worker's
own limit (read from its /server_info: never sent there to be refused), go through the prefill
worker. Greedy outputs equal the colocated server's either way."""

from __future__ import annotations

import re

import pytest
import requests
from support.pd_stand import InProcessRouter, Server, events_flag, greedy_body, prompt_ids, serving, wait_for

from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 5
ROUTER_LIMIT = 64  # the router sends prompts up to this long to the decode worker...
DECODE_LIMIT = 32  # ...which prefills only up to this: 33..64 go remote at once (the router knows it)


def requests_total(server: Server) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^pdserve_requests_total(?:\{[^}]*\})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def stand(colocated):
    servers = {
        "P": Server("lpP", "prefill", "--kv-events-config", events_flag(), "--max-total-tokens", "2048"),
        "D": Server("lpD", "decode", "--max-local-prefill-tokens", str(DECODE_LIMIT),
                    "--max-total-tokens", "2048"),
    }
    with serving(servers):
        yield servers


def test_short_prompts_stay_on_the_decode_worker(stand, reference):
    P, D = stand["P"], stand["D"]
    r = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                     decode=(WorkerSpec(D.url, "decode"),), prefill_policy="kv_aware",
                                     decode_policy="round_robin", local_prefill_max_tokens=ROUTER_LIMIT,
                                     health_check_interval_secs=3600))
    url = f"http://127.0.0.1:{r.port}/generate"
    try:
        policy = r.router.prefill_policy

        def warm() -> bool:  # until the policy knows the workers' page size and tokenizer
            assert requests.post(url, json=greedy_body(prompt_ids(100, 1), 1), timeout=120).status_code == 200
            return policy.encoder is not None

        wait_for(warm, 120, "the policy to know its workers")
        for n, route in ((20, "local"), (32, "local"), (48, "remote"), (150, "remote")):
            ids = prompt_ids(n, seed=n)
            before = requests_total(P)
            resp = requests.post(url, json=greedy_body(ids, MAX_NEW), timeout=120)
            assert resp.status_code == 200, resp.text
            assert resp.json()["output_ids"] == reference(ids, MAX_NEW), n
            assert resp.headers["x-pdserve-decode"] == D.url
            moved = requests_total(P) - before
            if route == "local":
                assert resp.headers["x-pdserve-prefill"] == "local" and moved == 0, (n, moved)
            else:
                assert resp.headers["x-pdserve-prefill"] == P.url and moved == 1, (n, moved)
        # streamed, local
        body = dict(greedy_body(prompt_ids(10, seed=10), MAX_NEW), stream=True)
        resp = requests.post(url, json=body, timeout=120)
        assert resp.status_code == 200 and resp.headers["x-pdserve-prefill"] == "local"
        assert resp.text.rstrip().endswith("data: [DONE]")
        metrics = r.router.metrics.render().decode()
        assert 'pdserve_router_prefills_total{mode="local"} 3.0' in metrics
        assert 'pdserve_router_prefills_total{mode="local_refused"} 0.0' in metrics  # none sent to be refused
    finally:
        r.close()
    P.wait_unleaked()
    D.wait_unleaked()
