"""The prompt's tokens by cache tier on the ``server.request`` spans of a traced 1P1D request.

Stand: a prefill server with the hierarchical cache (a 32-page KV pool, a host tier of twice that,
write-through, a ``file`` store) and a decode server, both tracing to an OTLP receiver in this
process, and a tracing router. One 150-token prompt is sent four times: first computed whole; then
again, its 9 full pages (144 tokens: the last token is always computed) from the KV pool; then,
after other prompts pushed it out of the pool, from the host tier; then, after a cache flush
emptied pool and host tier, from what the store fetched. Each time the prefill's span accounts
for every prompt token (pool + host + storage + computed); the decode's span carries the prefill's
cached total and no split (it computed nothing).
"""

from __future__ import annotations

import json
import random

import pytest
import requests
from support.pd_stand import ADMIN_HEADERS, InProcessRouter, Server, greedy_body, prompt_ids, serving

from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(600)

PROMPT = 150
CACHEABLE = 144  # whole 16-token pages, the last prompt token left to compute
TIERS = ("device", "host", "storage")


@pytest.fixture(scope="module")
def stand(otlp, tmp_path_factory):
    trace = ("--enable-trace", "--otlp-traces-endpoint", otlp.endpoint)
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    store = json.dumps({"path": str(tmp_path_factory.mktemp("store"))})
    servers = {"P": Server("tiers-P", "prefill", "--max-total-tokens", "512", "--enable-hierarchical-cache",
                           "--hicache-ratio", "2", "--hicache-storage-backend", "file",
                           "--hicache-storage-backend-extra-config", store,
                           "--hicache-storage-prefetch-policy", "wait_complete", *trace, env=env),
               "D": Server("tiers-D", "decode", "--max-total-tokens", "2048", *trace, env=env)}
    with serving(servers):
        P, D = servers["P"], servers["D"]
        router = InProcessRouter(RouterConfig(prefill=(WorkerSpec(P.url, "prefill", P.bootstrap_port),),
                                              decode=(WorkerSpec(D.url, "decode"),), health_check_interval_secs=3600,
                                              enable_trace=True, otlp_traces_endpoint=otlp.endpoint))
        try:
            router.wait_ready()
            yield P, D, router
        finally:
            router.close()


def traced(router, otlp, ids: list[int], rng: random.Random) -> dict[str, dict]:
    """Send ``ids`` under a sampled client trace; the attributes of each server's ``server.request``."""
    trace_id = f"{rng.getrandbits(128):032x}"
    r = requests.post(f"http://127.0.0.1:{router.port}/generate", json=greedy_body(ids, 4),
                      headers={"traceparent": f"00-{trace_id}-{rng.getrandbits(64):016x}-01"}, timeout=300)
    assert r.status_code == 200, r.text
    spans = otlp.wait_for(trace_id, {"server.request", "decode.first_step"})
    out = {s.service.removeprefix("pdserve-"): s.attributes for s in spans if s.name == "server.request"}
    assert set(out) == {"prefill", "decode"}, out
    return out


def split(attrs: dict) -> dict[str, int]:
    return {t: attrs[f"pdserve.cached_tokens.{t}"] for t in TIERS} | {"computed": attrs["pdserve.computed_prompt_tokens"]}


def test_prompt_tokens_by_tier_on_the_server_spans(stand, otlp):
    P, D, router = stand
    rng = random.Random(11)
    a = prompt_ids(PROMPT, seed=501)

    first = traced(router, otlp, a, rng)
    assert split(first["prefill"]) == {"device": 0, "host": 0, "storage": 0, "computed": PROMPT}

    again = traced(router, otlp, a, rng)
    assert split(again["prefill"]) == {"device": CACHEABLE, "host": 0, "storage": 0, "computed": PROMPT - CACHEABLE}
    for attrs in (first, again):
        d = attrs["decode"]
        assert d["pdserve.cached_tokens"] == attrs["prefill"]["pdserve.cached_tokens"]
        assert d["pdserve.prompt_tokens"] == PROMPT
        assert not any(k.startswith("pdserve.cached_tokens.") for k in d), d

    # four other prompts of 10 pages each: a's pages leave the 32-page pool, their host copies stay
    for seed in range(4):
        traced(router, otlp, prompt_ids(PROMPT, seed=600 + seed), rng)
    host = split(traced(router, otlp, a, rng)["prefill"])
    assert host["host"] > 0 and host["storage"] == 0, host
    assert host["device"] + host["host"] == CACHEABLE and host["computed"] == PROMPT - CACHEABLE

    # a flush empties the pool and the host tier; the store keeps what write-through put there
    r = requests.post(P.url + "/flush_cache", json={}, headers=ADMIN_HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    stored = split(traced(router, otlp, a, rng)["prefill"])
    assert stored == {"device": 0, "host": 0, "storage": CACHEABLE, "computed": PROMPT - CACHEABLE}, stored
    P.wait_unleaked()
    D.wait_unleaked()
