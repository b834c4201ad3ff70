"""The router's DP-rank choice against stand-in workers reporting 2 DP ranks, on real sockets:
under a skewed workload (a few long requests among many short ones, the long ones where round
robin would stack them on one rank) the tokens in flight per decode rank, as the router's
``/workers`` counts them while every request runs, stay within 1.5x of each other; they return
to zero when the requests end; a client's named rank is where its request runs."""

import asyncio

import pytest

from support.standin_worker import Behavior

pytestmark = pytest.mark.timeout(60)

LONG = (600, 200)  # (prompt tokens, max new tokens)
SHORT = (40, 24)


def skewed_workload(n: int = 64, longs: int = 4) -> list[dict]:
    """``longs`` long requests at the even places of the first ones (one rank under round robin)."""
    out = []
    for i in range(n):
        prompt, new = LONG if i % 2 == 0 and i < 2 * longs else SHORT
        out.append({"input_ids": [7] * prompt, "sampling_params": {"max_new_tokens": new}})
    return out


async def until(cond, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def endpoint_tokens(cluster, role: str) -> dict[str, int]:
    async with cluster.client.get(cluster.url + "/workers") as r:
        workers = (await r.json())[role]
    return {k: v for w in workers for k, v in w["endpoint_tokens"].items()}


async def test_least_tokens_keeps_decode_ranks_within_1_5x_under_skew(cluster):
    # the decode stand-in holds every answer, so all requests are in flight at once
    await cluster.start(1, 1, prefill_behavior=Behavior(dp_size=2, record=False),
                        decode_behavior=Behavior(dp_size=2, delay_s=120.0))
    decode = cluster.decodes[0]
    work = skewed_workload()
    tasks = []
    for body in work:  # sent one after another, so the router sees them in this order
        tasks.append(asyncio.ensure_future(cluster.post("/generate", body)))
        await asyncio.sleep(0)

    async def all_running() -> bool:
        return decode.in_flight == len(work)

    await until(all_running)
    tokens = await endpoint_tokens(cluster, "decode")
    want = sum(len(b["input_ids"]) + b["sampling_params"]["max_new_tokens"] for b in work)
    assert sum(tokens.values()) == want and len(tokens) == 2
    assert max(tokens.values()) <= 1.5 * min(tokens.values()), tokens
    ranks = [r.body["routed_dp_rank"] for r in decode.requests]
    longs = [r.body["routed_dp_rank"] for r in decode.requests if len(r.body["input_ids"]) == LONG[0]]
    assert sorted(set(ranks)) == [0, 1] and sorted(longs) == [0, 0, 1, 1], longs  # round robin: [0, 0, 0, 0]

    for t in tasks:  # the clients go away: the router cancels both legs and uncounts them
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    async def all_uncounted() -> bool:
        counts = {**await endpoint_tokens(cluster, "decode"), **await endpoint_tokens(cluster, "prefill")}
        return set(counts.values()) == {0}

    await until(all_uncounted)


async def test_a_named_rank_runs_there_even_when_busier(cluster):
    await cluster.start(1, 1, prefill_behavior=Behavior(dp_size=2), decode_behavior=Behavior(dp_size=2, delay_s=5.0))
    decode = cluster.decodes[0]
    body = {"input_ids": [3] * 50, "sampling_params": {"max_new_tokens": 4}}
    named = {**body, "routed_dp_rank": 1, "disagg_prefill_dp_rank": 0}
    first = asyncio.ensure_future(cluster.post("/generate", named))

    async def rank1_busy() -> bool:
        return (await endpoint_tokens(cluster, "decode"))[decode.url + "@1"] > 0

    await until(rank1_busy)
    second = asyncio.ensure_future(cluster.post("/generate", named))

    async def both_running() -> bool:
        return decode.in_flight == 2

    await until(both_running)
    third = asyncio.ensure_future(cluster.post("/generate", body))
    assert [s for s, _ in await asyncio.gather(first, second, third)] == [200, 200, 200]
    d = [r.body for r in decode.requests]
    p = [r.body for r in cluster.prefills[0].requests]
    assert [b["routed_dp_rank"] for b in d] == [1, 1, 0]  # named, named on the busy rank, then the rule
    assert [b["routed_dp_rank"] for b in p[:2]] == [0, 0] and [b["disagg_prefill_dp_rank"] for b in d[:2]] == [0, 0]
    status, err = await cluster.post("/generate", {**body, "routed_dp_rank": 2})
    assert status == 400 and err["error"]["param"] == "routed_dp_rank" and "ranks 0..1" in err["error"]["message"]
    assert len(decode.requests) == 3  # the refused one reached no worker
