"""Priority preemption on the decode side of a real 1P1D stand (router, prefill, decode over Mooncake).

The decode server's KV pool is 16 pages of 16 tokens. Two low-priority streams (40-token prompts,
80 new tokens: 7 pages at admission with the 64-token decode reserve, 8 at their end) hold 14 of
them and promise the rest, so a high-priority request (3 prompt pages and a reserve of 1) cannot be
preallocated while both run. It preempts the later low one: the decode counts one priority
preemption, the high request finishes before either low one, the victim resumes by recompute, and
every request's greedy output equals the same request served alone. Both pools end unleaked.
"""

from __future__ import annotations

import json
import threading

import pytest
import requests
from support.pd_stand import InProcessRouter, Server, greedy_body, prompt_ids, serving, wait_for

from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(900)

PRIORITY = ("--enable-priority-scheduling",)
PROMPT = 40
LOW_NEW, HIGH_NEW = 80, 16


@pytest.fixture(scope="module")
def stand():
    servers = {"P": Server("prio-P", "prefill", "--max-total-tokens", "2048", *PRIORITY),
               "D": Server("prio-D", "decode", "--max-total-tokens", "256", "--num-reserved-decode-tokens", "64",
                           *PRIORITY)}
    with serving(servers):
        P, D = servers["P"], servers["D"]
        router = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                              decode=(WorkerSpec(D.url, "decode"),), health_check_interval_secs=3600))
        try:
            router.wait_ready()
            yield P, D, router
        finally:
            router.close()


def body(seed: int, max_new: int, priority: int, stream: bool = False) -> dict:
    return dict(greedy_body(prompt_ids(PROMPT, seed), max_new), priority=priority, stream=stream)


def preemptions(server: Server) -> float:
    """The server's ``pdserve_preemptions_total{reason="priority"}``, summed over its ranks."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_preemptions_total{") and 'reason="priority"' in line)


def running(server: Server) -> int:
    return sum(s["num_running_reqs"] for s in server.states())


def test_a_high_priority_request_preempts_a_low_one_on_the_pd_decode(stand):
    P, D, router = stand
    url = f"http://127.0.0.1:{router.port}/generate"
    requests_ = {"low-a": body(1, LOW_NEW, 0), "low-b": body(2, LOW_NEW, 0), "high": body(3, HIGH_NEW, 10)}
    solo = {}
    for name, b in requests_.items():  # one at a time: nothing to preempt
        r = requests.post(url, json=b, timeout=300)
        assert r.status_code == 200, r.text
        solo[name] = r.json()["output_ids"]
        assert len(solo[name]) == b["sampling_params"]["max_new_tokens"]
    assert preemptions(D) == 0
    D.wait_unleaked()  # the solo runs' KV leaves the decode's prefix cache: the pool is all free

    done: list[str] = []
    outputs: dict[str, list[int]] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def stream_low(name: str, started: threading.Event) -> None:
        with requests.post(url, json=dict(requests_[name], stream=True), stream=True, timeout=600) as r:
            last = None
            for line in r.iter_lines():
                if not line or line == b"data: [DONE]":
                    continue
                started.set()
                last = json.loads(line.removeprefix(b"data: "))
            with lock:
                if r.status_code != 200 or last is None:
                    errors.append(f"{name}: {r.status_code}")
                    return
                done.append(name)
                outputs[name] = last["output_ids"]

    lows = []
    for name in ("low-a", "low-b"):
        started = threading.Event()
        t = threading.Thread(target=stream_low, args=(name, started))
        t.start()
        assert started.wait(300), f"{name} produced no token"
        lows.append(t)
    wait_for(lambda: running(D) == 2, 60, "both low requests decoding")
    high = requests.post(url, json=requests_["high"], timeout=600)
    assert high.status_code == 200, high.text
    with lock:
        done.append("high")
    for t in lows:
        t.join(600)
    assert not errors, errors
    assert done[0] == "high", done
    assert sorted(done) == ["high", "low-a", "low-b"]
    assert preemptions(D) >= 1
    assert preemptions(P) == 0  # the prefill side had room for all three
    assert high.json()["output_ids"] == solo["high"]
    for name in ("low-a", "low-b"):
        assert outputs[name] == solo[name], name
    P.wait_unleaked()
    D.wait_unleaked()
