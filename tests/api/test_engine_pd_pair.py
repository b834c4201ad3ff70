"""Two offline Engines in one program form a 1P1D pair (SGLang's Engine with
``disaggregation_mode``): the prefill Engine's KV reaches the decode Engine over Mooncake (TCP)
or NIXL (UCX), and greedy fp32 outputs equal the colocated Engine's. Also the streaming
semantics: cumulative chunks by default (SGLang's), incremental with
``incremental_streaming_output`` (the decode Engine here)."""

from __future__ import annotations

import asyncio
import os

import pytest

from pdserve.engine import Engine
from pdserve.entrypoints.procs import free_port

pytestmark = pytest.mark.timeout(600)

FLAGS = dict(dtype="float32", max_total_tokens=4096, num_threads=1)
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived a"]


@pytest.fixture(scope="module")
def colocated():
    with Engine(**FLAGS) as e:
        yield e


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pair(request):
    port = free_port()
    kv = dict(disaggregation_transfer_backend=request.param, **FLAGS)
    # an in-process NIXL engine binds UCX to its host's interface through this process's
    # UCX_NET_DEVICES; later tests' children (in network namespaces) must not inherit it
    ucx_devices = os.environ.get("UCX_NET_DEVICES")
    try:
        with Engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port, rank_on_thread=True, **kv) as prefill, \
                Engine(disaggregation_mode="decode", incremental_streaming_output=True, rank_on_thread=True,
                       **kv) as decode:
            yield prefill, decode, port
    finally:
        if ucx_devices is None:
            os.environ.pop("UCX_NET_DEVICES", None)
        else:
            os.environ["UCX_NET_DEVICES"] = ucx_devices


def boot(port: int, rooms) -> dict:
    return dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=rooms)


def test_pd_pair_matches_colocated(pair, colocated):
    prefill, decode, port = pair
    want = [o["output_ids"] for o in colocated.generate(PROMPTS, GREEDY)]

    async def both():
        b = boot(port, [101, 102, 103])
        return await asyncio.gather(prefill.async_generate(PROMPTS, GREEDY, **b),
                                    decode.async_generate(PROMPTS, GREEDY, **b))

    pre, dec = asyncio.run(both())
    assert [o["output_ids"] for o in dec] == want
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in dec)
    assert all(len(o["output_ids"]) == 1 for o in pre)  # the prefill leg's answer: its first token
    info = decode.get_server_info()
    assert info["disaggregation_mode"] == "decode" and info["disaggregation_transfer_backend"] == prefill.get_server_info()[
        "disaggregation_transfer_backend"]
    prefill.check_integrity()
    decode.check_integrity()


def test_streams_cumulative_by_default_incremental_when_asked(pair, colocated):
    prefill, decode, port = pair
    full = colocated.generate(PROMPTS[0], GREEDY)
    chunks = list(colocated.generate(PROMPTS[0], GREEDY, stream=True))
    assert len(chunks) > 1
    for a, b in zip(chunks, chunks[1:]):  # each chunk holds everything so far
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]

    # the decode Engine streams incrementally; the prefill leg runs in a thread of its own
    async def leg():
        return await prefill.async_generate(PROMPTS[0], GREEDY, **boot(port, 7))

    async def main():
        task = asyncio.ensure_future(leg())
        pieces = [c async for c in await decode.async_generate(PROMPTS[0], GREEDY, stream=True, **boot(port, 7))]
        await task
        return pieces

    pieces = asyncio.run(main())
    assert len(pieces) > 1
    assert "".join(p["text"] for p in pieces) == full["text"]
    assert sum((p["output_ids"] for p in pieces), []) == full["output_ids"]
    assert pieces[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_pd_engine_arguments_refused():
    with pytest.raises(ValueError, match="disaggregation_mode"):
        Engine(disaggregation_mode="both", **FLAGS)
    with pytest.raises(ValueError, match="disagregation_bootstrap_port"):
        Engine(disagregation_bootstrap_port=1, **FLAGS)
    with pytest.raises(ValueError, match="tp_size"):
        Engine(tp_size=2, **FLAGS)
