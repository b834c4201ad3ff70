"""Request migration through the router's real request path, on stand-in workers (no model):
what the continuation asks for, what the client reads, and the outcomes that end with an error."""

from __future__ import annotations

import msgspec


async def stream(cluster, body: dict) -> tuple[int, list[dict], dict]:
    async with cluster.client.post(cluster.url + "/generate", json=body) as r:
        raw = await r.read()
        events = [msgspec.json.decode(e[6:]) for e in raw.split(b"\n\n")
                  if e.startswith(b"data: ") and e != b"data: [DONE]"]
        return r.status, events, dict(r.headers)


def body(max_new: int = 8) -> dict:
    return {"input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "seed": 11}}


def migrations(cluster) -> dict[str, float]:
    out = {}
    for line in cluster.router.metrics.render().decode().splitlines():
        if line.startswith("pdserve_router_migrations_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("pdserve_router_migrations_total"):]] = float(value)
    return out


async def test_a_stream_whose_decode_dies_continues_on_the_other(cluster):
    await cluster.start(1, 2, policy="round_robin", migration_limit=2)
    dying = cluster.decodes[0]
    dying.behavior.fail_midstream_after = 3
    status, events, headers = await stream(cluster, body(8))
    assert status == 200 and headers["x-pdserve-migration-limit"] == "2"
    first, other = (cluster.decodes if headers["x-pdserve-decode"] == dying.url
                    else cluster.decodes[::-1])
    assert first is dying, "round robin sent the first request to the first decode"
    assert not any("error" in e for e in events), events
    # the continuation: prompt + the 3 ids sent, 5 tokens left, the sampling settings kept
    cont = other.requests[-1].body
    assert cont["input_ids"] == [5, 6, 7, 100, 101, 102] and "text" not in cont
    assert cont["sampling_params"] == {"max_new_tokens": 5, "temperature": 0, "seed": 11}
    assert cont["bootstrap_room"] != dying.requests[-1].body["bootstrap_room"]  # a new room
    assert len(cluster.prefills[0].requests) == 2  # the continuation was prefilled anew
    ids = [i for e in events for i in e["output_ids"]]  # the stand-ins stream deltas of ids
    assert ids == [100, 101, 102, 100, 101, 102, 103, 104]
    last = events[-1]["meta_info"]
    assert last["completion_tokens"] == 8 and last["pdserve_migrations"] == 1
    assert last["id"] == events[0]["meta_info"]["id"]
    assert migrations(cluster) == {'{cause="connection_lost",outcome="migrated"}': 1.0}


async def test_limit_reached_ends_with_todays_error(cluster):
    await cluster.start(1, 2, policy="round_robin", migration_limit=1)
    for d in cluster.decodes:
        d.behavior.fail_midstream_after = 2
    status, events, _ = await stream(cluster, body(8))
    assert status == 200
    assert "failed mid-stream" in events[-1]["error"]["message"]
    assert [i for e in events[:-1] for i in e["output_ids"]] == [100, 101, 100, 101]  # none lost
    assert migrations(cluster) == {'{cause="connection_lost",outcome="migrated"}': 1.0,
                                   '{cause="connection_lost",outcome="limit"}': 1.0}


async def test_no_other_decode_ends_with_todays_error(cluster):
    await cluster.start(1, 1, migration_limit=2)
    cluster.decodes[0].behavior.fail_midstream_after = 2
    status, events, _ = await stream(cluster, body(8))
    assert "failed mid-stream" in events[-1]["error"]["message"]
    assert len(cluster.decodes[0].requests) == 1  # never sent back to the server that failed
    assert migrations(cluster) == {'{cause="connection_lost",outcome="no_pair"}': 1.0}


async def test_migration_off_by_default(cluster):
    await cluster.start(1, 2, policy="round_robin")
    cluster.decodes[0].behavior.fail_midstream_after = 2
    status, events, headers = await stream(cluster, body(8))
    assert "failed mid-stream" in events[-1]["error"]["message"]
    assert "x-pdserve-migration-limit" not in {k.lower() for k in headers}
    assert len(cluster.decodes[1].requests) == 0 and migrations(cluster) == {}
