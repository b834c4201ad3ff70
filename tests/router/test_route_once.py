"""One routing decision per request: a streamed request is read (and tokenized) once and enters
each routing policy once, on the prefill/decode path and on the local-prefill path alike. The
policies' methods are wrapped to count their calls; the calls still reach the real policies,
stand-in workers answer on real sockets, the tokenizer is the default model's."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from support.standin_worker import Behavior

pytestmark = pytest.mark.timeout(90)
LONG = {"text": " ".join(["word"] * 200), "stream": True, "sampling_params": {"max_new_tokens": 2}}
SHORT = {"text": "Hello there", "stream": True, "sampling_params": {"max_new_tokens": 2}}
ENTRIES = ("pick", "route", "uncached_on", "predict_on", "select")


def count_calls(obj, names, calls: Counter, tag: str) -> None:
    """Wrap ``obj``'s methods ``names`` so each call is counted under ``tag.name`` (and still runs)."""
    for name in names:
        real = getattr(obj, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[f"{tag}.{_name}"] += 1
            return _real(*args, **kwargs)
        setattr(obj, name, counted)


async def _stream(cluster, body) -> tuple[int, bytes]:
    async with cluster.client.post(cluster.url + "/generate", json=body) as r:
        return r.status, await r.read()


async def _ready(cluster, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        async with cluster.client.get(cluster.url + "/readiness") as r:
            if r.status == 200:
                return
        assert time.monotonic() < deadline, "router never became ready"
        await asyncio.sleep(0.02)


@pytest.fixture
async def counted(cluster):
    model = Behavior(model=None)  # /server_info model_path None: the default model's tokenizer
    await cluster.start(1, 1, prefill_behavior=model, decode_behavior=model, policy="cache_aware",
                        local_prefill_max_tokens=64)
    await _ready(cluster)
    router = cluster.router
    calls: Counter = Counter()
    count_calls(router.prefill_policy, ENTRIES, calls, "prefill")
    count_calls(router.decode_policy, ENTRIES, calls, "decode")
    count_calls(router.prompt_tokenizer, ("_encode",), calls, "tokenizer")
    return cluster, calls


async def test_a_streamed_request_enters_each_policy_once(counted):
    cluster, calls = counted
    status, data = await _stream(cluster, LONG)  # 200 tokens > 64: the prefill/decode path
    assert status == 200 and b"data:" in data
    assert len(cluster.prefills[0].requests) == 1  # it did take the prefill/decode path
    assert calls["tokenizer._encode"] == 1  # tokenized once
    # the prefill policy: one decision (its own pick and the local check inside it)
    assert calls["prefill.route"] == 1
    assert calls["prefill.pick"] == calls["prefill.uncached_on"] == 1
    assert calls["decode.pick"] == 1 and calls["decode.route"] == 0
    assert calls["prefill.predict_on"] == 0


async def test_a_local_prefill_enters_each_policy_once(counted):
    cluster, calls = counted
    status, data = await _stream(cluster, SHORT)  # short: the decode worker prefills it
    assert status == 200 and b"data:" in data
    assert not cluster.prefills[0].requests
    assert calls["tokenizer._encode"] == 1
    assert calls["prefill.route"] == 1 and calls["prefill.uncached_on"] == 1
    assert calls["prefill.predict_on"] == 1  # its prompt will be cached on the decode worker
    assert calls["prefill.pick"] == 0  # no prefill endpoint was chosen
    assert calls["decode.pick"] == 1
