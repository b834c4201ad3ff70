"""``kv_aware`` in front of two prefill workers that publish KV events (Mooncake over TCP).

A shared-prefix chat workload: after a group's first request, every later one
goes to the worker that caches its prefix (the workers' own
``pdserve_cached_tokens_total`` moves on that worker only); after that worker's
``/flush_cache`` the router's index forgets it, and a group held by both goes
to the one that still has it.
"""

from __future__ import annotations

import re

import pytest
import requests
from support.pd_stand import InProcessRouter, Server, events_flag, pd_post, serving, wait_for

from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(600)
GROUPS = 4
REPEATS = 3


def cached_tokens(server: Server) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^pdserve_cached_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def chat(group: int, i: int) -> dict:
    # the system prompt is the shared prefix: ~120 tokens, several 16-token pages
    system = f"You are assistant number {group}. " + " ".join(f"rule {group}.{k}: be brief." for k in range(20))
    return {"model": "default", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]}


@pytest.fixture(scope="module")
def stand():
    extra = ["--max-total-tokens", "4096"]
    servers = {
        "PA": Server("kvPA", "prefill", "--kv-events-config", events_flag(), *extra),
        "PB": Server("kvPB", "prefill", "--kv-events-config", events_flag(), *extra),
        "D": Server("kvD", "decode", *extra),
    }
    with serving(servers):
        yield servers


def test_kv_aware_sends_each_prefix_group_to_its_holder(stand):
    PA, PB, D = stand["PA"], stand["PB"], stand["D"]
    config = RouterConfig(prefill=(WorkerSpec(PA.url, "prefill", PA.bootstrap_port),
                                   WorkerSpec(PB.url, "prefill", PB.bootstrap_port)),
                          decode=(WorkerSpec(D.url, "decode"),), prefill_policy="kv_aware",
                          decode_policy="round_robin", health_check_interval_secs=3600)
    holder = {}
    r = InProcessRouter(config)
    try:
        policy = r.router.prefill_policy
        # the first request makes the policy discover the workers' event endpoints and tokenizer
        def warm() -> bool:
            assert r.post(chat(99, 0)).status_code == 200
            return policy.routed["kv_routed"] > 0

        wait_for(warm, 120, "the policy to route by KV events")
        by_url = {PA.url: PA, PB.url: PB}
        for g in range(GROUPS):
            before = {u: cached_tokens(s) for u, s in by_url.items()}
            blocks = sum(policy.index.num_blocks(u) for u in by_url)
            assert r.post(chat(g, 0)).status_code == 200
            wait_for(lambda: sum(policy.index.num_blocks(u) for u in by_url) > blocks, 30,
                     "the first request's stored event")
            firsts = {u: cached_tokens(s) - before[u] for u, s in by_url.items()}
            for i in range(1, REPEATS + 1):
                resp = r.post(chat(g, i))
                assert resp.status_code == 200, resp.text
            hits = {u: cached_tokens(s) - before[u] - firsts[u] for u, s in by_url.items()}
            winner = max(hits, key=hits.get)
            holder[g] = winner
            assert hits[winner] >= REPEATS * 96, (g, hits)  # the shared system prompt's pages hit
            assert all(v == 0 for u, v in hits.items() if u != winner), (g, hits)
        assert set(holder.values()) == set(by_url), f"new groups spread over both workers: {holder}"

        # group 0 also on the other worker (directly, not through the router), then its holder flushes
        x = holder[0]
        other = next(u for u in by_url if u != x)
        X, Y = by_url[x], by_url[other]
        p, d = pd_post(Y, D, "/v1/chat/completions", chat(0, 50))
        assert p.status_code == 200 and d.status_code == 200
        assert requests.post(X.url + "/flush_cache", json={}, timeout=10).status_code == 200
        wait_for(lambda: policy.index.num_blocks(x) == 0, 30, "the flush to reach the index")
        before = {u: cached_tokens(s) for u, s in by_url.items()}
        assert r.post(chat(0, 51)).status_code == 200
        assert cached_tokens(Y) - before[other] >= 96 and cached_tokens(X) == before[x]
        assert policy.subscriber.counts["malformed"] == 0
    finally:
        r.close()
