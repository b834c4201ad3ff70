"""Conditional disaggregation from one flag (issue 27): ``--local-prefill-max-tokens`` works under
every prefill policy (the router counts prompts with its own tokenizer when the policy does not
tokenize), the router is not ready until that tokenizer is loaded, and a decode worker that does
not accept local prefills is named in a warning at registration, shows its limit in ``/workers``
and gets no local prefill. Stand-in workers; the tokenizer is the default model's."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from standin_worker import Behavior

from pdserve.router.policy import policy_class

pytestmark = pytest.mark.timeout(60)
SHORT = {"text": "Hello there", "sampling_params": {"max_new_tokens": 2}}
LONG = {"text": " ".join(["word"] * 200), "sampling_params": {"max_new_tokens": 2}}


async def _ready(cluster, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        async with cluster.client.get(cluster.url + "/readiness") as r:
            body = await r.json(content_type=None)
            if r.status == 200:
                return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
async def test_local_prefill_by_size_under_a_policy_that_does_not_tokenize(cluster, policy):
    assert not policy_class(policy).tokenizes
    model = Behavior(model=None)  # /server_info model_path None: the default model's tokenizer
    await cluster.start(1, 1, prefill_behavior=model, decode_behavior=model, policy=policy,
                        local_prefill_max_tokens=64)
    await _ready(cluster)
    assert cluster.router.prompt_tokenizer.ready  # readiness waited for it
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    status, _ = await cluster.post("/generate", SHORT)  # the first request after readiness
    assert status == 200 and not prefill.requests
    assert "bootstrap_room" not in decode.requests[-1].body  # prefilled on the decode worker
    status, _ = await cluster.post("/generate", LONG)  # 200 tokens > 64: the prefill path
    assert status == 200 and len(prefill.requests) == 1
    assert "bootstrap_room" in decode.requests[-1].body


async def test_readiness_names_the_tokenizer_while_it_loads(cluster):
    await cluster.start(1, 1, prefill_behavior=Behavior(model=None), decode_behavior=Behavior(model=None),
                        policy="round_robin", local_prefill_max_tokens=64)
    tok = cluster.router.prompt_tokenizer
    seen_loading = False
    while not tok.ready:
        async with cluster.client.get(cluster.url + "/readiness") as r:
            body = await r.json(content_type=None)
        if cluster.router.gate.is_open and not tok.ready:  # a pair exists, the tokenizer does not
            assert r.status == 503 and "tokenizer" in body["message"], body
            seen_loading = True
        await asyncio.sleep(0.01)
    await _ready(cluster)
    # the stand-ins answer at once and the tokenizer takes about a second: the gap was seen
    assert seen_loading


async def test_a_decode_worker_without_local_prefill_is_named_and_not_sent_any(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.router.workers.health")
    await cluster.start(1, 1, prefill_behavior=Behavior(model=None),
                        decode_behavior=Behavior(model=None, max_local_prefill_tokens=0),
                        policy="round_robin", local_prefill_max_tokens=64)
    await _ready(cluster)
    decode = cluster.decodes[0]
    warned = [r.getMessage() for r in caplog.records if decode.url in r.getMessage()]
    assert warned and "--max-local-prefill-tokens" in warned[0] and "does not accept local prefills" in warned[0]
    async with cluster.client.get(cluster.url + "/workers") as r:
        assert r.status == 200
        listed = await r.json()
    assert listed["decode"][0]["url"] == decode.url and listed["decode"][0]["max_local_prefill_tokens"] == 0
    assert listed["prefill"][0]["max_local_prefill_tokens"] is None
    status, _ = await cluster.post("/generate", SHORT)
    assert status == 200 and len(cluster.prefills[0].requests) == 1  # through the prefill server
    assert "bootstrap_room" in decode.requests[-1].body


async def test_a_prompt_above_the_decode_workers_own_limit_is_not_sent_there(cluster):
    await cluster.start(1, 1, prefill_behavior=Behavior(model=None),
                        decode_behavior=Behavior(model=None, max_local_prefill_tokens=4),
                        policy="round_robin", local_prefill_max_tokens=64)
    await _ready(cluster)
    ids = {"input_ids": list(range(10, 20)), "sampling_params": {"max_new_tokens": 2}}  # 10 tokens: 4 < 10 <= 64
    status, _ = await cluster.post("/generate", ids)
    assert status == 200 and len(cluster.prefills[0].requests) == 1  # the prefill path, at once
    status, _ = await cluster.post("/generate", {**ids, "input_ids": [1, 2, 3]})
    assert status == 200 and len(cluster.prefills[0].requests) == 1  # 3 <= 4: local
    assert 'pdserve_router_prefills_total{mode="local_refused"} 0.0' in cluster.router.metrics.render().decode()
