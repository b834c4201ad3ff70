"""The router's ``router.route`` span carries what the router knows of the prompt's tokens: its
own count, and with local prefill (``--local-prefill-max-tokens``) what the chosen decode worker
would compute of it. Stand-in workers, the router tracing to an OTLP receiver in this process;
the servers' spans with the measured split by cache tier: ``tests/pd/test_trace_cache_tiers.py``."""

from __future__ import annotations

import asyncio
import random

import pytest
from support.otlp_receiver import OtlpReceiver
from support.standin_worker import Behavior

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


async def test_the_route_span_counts_the_prompt(cluster, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    model = Behavior(model=None)  # the default model's tokenizer
    await cluster.start(1, 1, prefill_behavior=model, decode_behavior=model, policy="round_robin",
                        local_prefill_max_tokens=8, enable_trace=True, otlp_traces_endpoint=receiver.endpoint)
    while not cluster.router.prompt_tokenizer.ready:
        await asyncio.sleep(0.05)
    rng = random.Random(5)
    seen = {}
    for name, ids in (("short", [11, 12, 13]), ("long", list(range(100, 140)))):
        trace_id = f"{rng.getrandbits(128):032x}"
        status, _ = await cluster.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}},
                                       headers={"traceparent": f"00-{trace_id}-{rng.getrandbits(64):016x}-01"})
        assert status == 200
        spans = await asyncio.to_thread(receiver.wait_for, trace_id, {"router.route"})
        (route,) = [s for s in spans if s.name == "router.route"]
        seen[name] = route.attributes
    assert seen["short"]["pdserve.prompt_tokens"] == 3 and seen["short"]["pdserve.prefill"] == "local"
    assert seen["long"]["pdserve.prompt_tokens"] == 40
    # round_robin knows no cache: the decode worker would compute the whole prompt
    assert seen["long"]["pdserve.decode_uncached_tokens"] == 40
    assert seen["long"]["pdserve.prefill"] != "local"
