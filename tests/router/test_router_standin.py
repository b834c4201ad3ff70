"""The router against stand-in prefill/decode workers on real sockets: the happy paths,
SGLang's wire protocol, and every failure path (retries, cancellation of the other leg,
mid-stream failure, client disconnect, health removal and return, 429, 413, 401, 400,
dynamic add/remove while requests are in flight)."""

import asyncio
from urllib.parse import quote

import aiohttp
import msgspec
import pytest

from support.standin_worker import Behavior, StandinWorker

pytestmark = pytest.mark.timeout(30)


async def wait_for(cond, timeout=3.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def sse_events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return out


def assert_error(status, body, code):
    assert status == code
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"]


# -- happy paths and wire format ------------------------------------------------------

async def test_generate_sends_same_room_to_both_legs_and_answers_with_decode(cluster):
    await cluster.start(2, 2)
    extras = {"model": None, "return_text_in_logprobs": True, "log_metrics": True,
              "return_hidden_states": False, "no_logs": False}  # SGLang's extras pass through
    for i in range(4):
        status, body = await cluster.post("/generate", {"text": f"{i} hi", **extras,
                                                        "sampling_params": {"max_new_tokens": 3}})
        assert status == 200 and body["text"] == " t0 t1 t2"
    p_rooms = [r for w in cluster.prefills for r in w.rooms()]
    d_rooms = [r for w in cluster.decodes for r in w.rooms()]
    assert sorted(p_rooms) == sorted(d_rooms) and len(set(p_rooms)) == 4
    rec = cluster.prefills[0].requests[0]
    assert rec.body["bootstrap_host"] == "127.0.0.1" and rec.body["bootstrap_port"] == 8998
    assert all(k in rec.body for k in extras)
    # cache_aware (the default) with distinct prompts spreads over both prefills
    assert all(w.requests for w in cluster.prefills)


async def test_openai_routes_json_and_stream(cluster):
    await cluster.start(1, 1)
    status, body = await cluster.post("/v1/chat/completions", {
        "model": "my-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "separate_reasoning": True, "no_stop_trim": False})
    assert status == 200 and body["choices"][0]["message"]["content"] == " t0 t1 t2"
    assert cluster.decodes[0].requests[-1].body["model"] == "my-model"
    for path, body in (("/v1/completions", {"prompt": "a b", "max_tokens": 5, "stream": True}),
                       ("/generate", {"text": "a b", "stream": True,
                                      "sampling_params": {"max_new_tokens": 5}})):
        async with cluster.client.post(cluster.url + path, json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await r.text())
        assert len(events) == 6 and events[-1] == "[DONE]"
    # the prefill leg got stream: true too and answered in SSE with one token
    assert cluster.prefills[0].completed == 3


async def test_models_workers_health_metrics(cluster):
    await cluster.start(1, 1)
    async with cluster.client.get(cluster.url + "/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "standin-model"
    async with cluster.client.get(cluster.url + "/get_server_info") as r:
        assert (await r.json())["dp_size"] == 1
    async with cluster.client.get(cluster.url + "/workers") as r:
        workers = await r.json()
    assert [w["url"] for w in workers["prefill"]] == [cluster.prefills[0].url]
    assert workers["decode"][0]["healthy"] is True
    await cluster.post("/generate", {"text": "x"})
    async with cluster.client.get(cluster.url + "/metrics") as r:
        text = await r.text()
    assert f'pdserve_router_worker_requests_total{{worker="{cluster.prefills[0].url}",leg="prefill"}} 1' in text
    assert 'pdserve_router_requests_total{route="/generate",status="200"} 1' in text
    assert "pdserve_router_e2e_seconds_count 1" in text
    assert "pdserve_router_ttft_seconds_count 1" in text
    assert f'pdserve_router_worker_in_flight{{worker="{cluster.decodes[0].url}",role="decode"}} 0' in text


async def test_prompt_logprobs_come_from_prefill(cluster):
    await cluster.start(1, 1)
    status, body = await cluster.post("/generate", {"text": "one two three", "return_logprob": True,
                                                    "logprob_start_len": 0,
                                                    "sampling_params": {"max_new_tokens": 2}})
    assert status == 200
    assert len(body["meta_info"]["input_token_logprobs"]) == 3  # the prompt, from the prefill leg
    assert len(body["meta_info"]["output_token_logprobs"]) == 2  # from the decode leg


async def test_dp_ranks_reported_by_workers_are_routed(cluster):
    await cluster.start(1, 1, prefill_behavior=Behavior(dp_size=2), decode_behavior=Behavior(dp_size=2),
                        policy="round_robin")
    for _ in range(4):
        assert (await cluster.post("/generate", {"text": "x"}))[0] == 200
    p = [r.body for r in cluster.prefills[0].requests]
    d = [r.body for r in cluster.decodes[0].requests]
    assert [b["routed_dp_rank"] for b in p] == [0, 1, 0, 1]
    assert [b["disagg_prefill_dp_rank"] for b in p] == [0, 1, 0, 1]
    assert [b["routed_dp_rank"] for b in d] == [0, 1, 0, 1]
    assert [b["disagg_prefill_dp_rank"] for b in d] == [0, 1, 0, 1]


# -- failures before the first byte: cancel the other leg, retry on a new pair ----------

async def test_prefill_failure_cancels_decode_and_retries_with_new_room(cluster):
    await cluster.start(1, 1, prefill_behavior=Behavior(fail_status=500, fail_times=1),
                        decode_behavior=Behavior(delay_s=0.3))
    status, body = await cluster.post("/generate", {"text": "x"})
    assert status == 200 and body["text"]
    dec = cluster.decodes[0]
    assert len(dec.requests) == 2
    first_room, second_room = dec.rooms()
    assert first_room != second_room
    # the decode leg of the failed attempt saw its client (the router) go away
    await wait_for(lambda: [r.body["bootstrap_room"] for r in dec.cancelled] == [first_room])
    async with cluster.client.get(cluster.url + "/metrics") as r:
        text = await r.text()
    assert "pdserve_router_retries_total 1" in text
    assert f'pdserve_router_worker_errors_total{{worker="{cluster.prefills[0].url}",leg="prefill"}} 1' in text
    assert 'pdserve_router_retries_by_cause_total{leg="prefill",cause="http_500"} 1.0' in text
    # the second attempt's legs succeeded: one latency each
    assert 'pdserve_router_leg_latency_seconds_count{leg="prefill"} 1.0' in text
    assert 'pdserve_router_leg_latency_seconds_count{leg="decode"} 1.0' in text


async def test_decode_failure_cancels_prefill_and_moves_to_another_decode(cluster):
    await cluster.start(1, 2, prefill_behavior=Behavior(delay_s=0.3), policy="round_robin")
    bad, good = cluster.decodes
    bad.behavior.fail_status = 503
    for _ in range(3):
        async with cluster.client.post(cluster.url + "/generate",
                                       json={"text": "x", "stream": True}) as r:
            assert r.status == 200
            assert sse_events(await r.text())[-1] == "[DONE]"
    # each time the bad decode was tried, the prefill leg of that attempt was cancelled
    bad_rooms = set(bad.rooms())
    assert bad_rooms
    await wait_for(lambda: {r.body["bootstrap_room"] for r in cluster.prefills[0].cancelled} == bad_rooms)
    assert good.completed == 3


async def test_retries_exhausted_is_a_clear_5xx(cluster):
    await cluster.start(1, 1, decode_behavior=Behavior(fail_status=500), retry_max_retries=3)
    status, body = await cluster.post("/v1/completions", {"prompt": "x"})
    assert_error(status, body, 502)
    assert "3 attempt" in body["error"]["message"] and cluster.decodes[0].url in body["error"]["message"]
    assert len(cluster.decodes[0].requests) == 3
    assert len(set(cluster.decodes[0].rooms())) == 3


async def test_hanging_leg_times_out_and_is_retried(cluster):
    await cluster.start(2, 1, request_timeout_secs=0.5, policy="round_robin")
    cluster.prefills[0].behavior.hang = True
    status, _ = await cluster.post("/generate", {"text": "x"})
    assert status == 200
    assert cluster.prefills[1].completed == 1
    await wait_for(lambda: len(cluster.prefills[0].cancelled) == 1)


async def test_worker_client_error_is_passed_through_without_retry(cluster):
    await cluster.start(1, 1, decode_behavior=Behavior(fail_status=400))
    status, body = await cluster.post("/generate", {"text": "x"})
    assert_error(status, body, 400)
    assert len(cluster.decodes[0].requests) == 1


# -- after streaming began -----------------------------------------------------------

async def test_mid_stream_failure_ends_with_an_error_event(cluster):
    await cluster.start(1, 1, decode_behavior=Behavior(fail_midstream_after=2, num_tokens=6))
    async with cluster.client.post(cluster.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
        assert r.status == 200
        events = sse_events(await r.text())
    assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == [" t0", " t1"]
    assert events[2]["error"]["code"] == 502 and "mid-stream" in events[2]["error"]["message"]
    assert events[-1] == "[DONE]" and len(events) == 4
    assert len(cluster.decodes[0].requests) == 1  # no retry once bytes went out


async def test_json_decode_failure_cancels_prefill_and_moves_to_another_decode(cluster):
    # the JSON path awaits its decode leg in the request's own task: its failure cancels the
    # prefill leg still out, as a failed prefill leg cancels the decode leg (above)
    await cluster.start(1, 2, prefill_behavior=Behavior(delay_s=0.3), policy="round_robin")
    bad, good = cluster.decodes
    bad.behavior.fail_status = 503
    for _ in range(3):
        status, body = await cluster.post("/generate", {"text": "x"})
        assert status == 200 and body["text"]
    bad_rooms = set(bad.rooms())
    assert bad_rooms
    await wait_for(lambda: {r.body["bootstrap_room"] for r in cluster.prefills[0].cancelled} == bad_rooms)
    assert good.completed == 3
    await wait_for(lambda: all(w.load == 0 for w in cluster.router.registry.workers()))


# -- client disconnect ------------------------------------------------------------------

async def test_client_disconnect_cancels_both_legs(cluster):
    await cluster.start(1, 1, prefill_behavior=Behavior(hang=True), decode_behavior=Behavior(hang=True))
    with pytest.raises(asyncio.TimeoutError):
        await cluster.client.post(cluster.url + "/generate", json={"text": "x"},
                                  timeout=aiohttp.ClientTimeout(total=0.3))
    await wait_for(lambda: len(cluster.prefills[0].cancelled) == 1 and len(cluster.decodes[0].cancelled) == 1)
    assert cluster.prefills[0].cancelled[0].body["bootstrap_room"] == cluster.decodes[0].cancelled[0].body["bootstrap_room"]
    await wait_for(lambda: all(w.load == 0 for w in cluster.router.registry.workers()))


async def test_client_disconnect_mid_stream_cancels_decode(cluster):
    await cluster.start(1, 1, decode_behavior=Behavior(num_tokens=50, token_delay_s=0.05))
    r = await cluster.client.post(cluster.url + "/generate", json={"text": "x", "stream": True})
    assert r.status == 200
    first = await r.content.readuntil(b"\n\n")
    assert first.startswith(b"data: ")
    r.close()  # the client goes away
    dec = cluster.decodes[0]
    await wait_for(lambda: len(dec.cancelled) == 1)
    assert dec.completed == 0
    await wait_for(lambda: all(w.load == 0 for w in cluster.router.registry.workers()))


# -- health -------------------------------------------------------------------------------

async def test_health_removal_and_return(cluster):
    await cluster.start(1, 1, health_check_interval_secs=0.05, health_failure_threshold=2,
                        health_success_threshold=2)
    dec = cluster.decodes[0]
    dec.behavior.health_status = 503
    await wait_for(lambda: not cluster.router.registry.workers("decode")[0].healthy)
    status, body = await cluster.post("/generate", {"text": "x"})
    assert_error(status, body, 503)
    assert "decode" in body["error"]["message"]
    assert dec.requests == []
    async with cluster.client.get(cluster.url + "/health") as r:
        assert r.status == 200 and (await r.json())["healthy_endpoints"] == {"prefill": 1, "decode": 0}
    dec.behavior.health_status = 200
    await wait_for(lambda: cluster.router.registry.workers("decode")[0].healthy)
    assert (await cluster.post("/generate", {"text": "x"}))[0] == 200


# -- admission -----------------------------------------------------------------------------

async def test_queue_full_and_queue_timeout_are_429(cluster):
    await cluster.start(1, 1, decode_behavior=Behavior(delay_s=0.4), max_concurrent_requests=1,
                        queue_size=1, queue_timeout_secs=0.1)
    results = await asyncio.gather(*(cluster.post("/generate", {"text": str(i)}) for i in range(3)))
    statuses = sorted(s for s, _ in results)
    assert statuses == [200, 429, 429]
    messages = " ".join(b["error"]["message"] for s, b in results if s == 429)
    assert "full" in messages and "longer than" in messages
    for s, b in results:
        if s == 429:
            assert_error(s, b, 429)
    assert len(cluster.decodes[0].requests) == 1


async def test_queued_request_runs_when_a_slot_frees(cluster):
    await cluster.start(1, 1, decode_behavior=Behavior(delay_s=0.1), max_concurrent_requests=2,
                        queue_size=10, queue_timeout_secs=5)
    results = await asyncio.gather(*(cluster.post("/generate", {"text": str(i)}) for i in range(8)))
    assert [s for s, _ in results] == [200] * 8
    assert cluster.router.admission.active == 0


async def test_payload_too_large_is_413(cluster):
    await cluster.start(1, 1, max_payload_size=1000)
    status, body = await cluster.post("/generate", {"text": "x" * 2000})
    assert_error(status, body, 413)

    async def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(4):
            yield b"x" * 500

    async with cluster.client.post(cluster.url + "/generate", data=chunks()) as r:
        assert_error(r.status, await r.json(), 413)
    assert cluster.decodes[0].requests == []
    assert (await cluster.post("/generate", {"text": "small"}))[0] == 200


async def test_api_key(cluster):
    await cluster.start(1, 1, api_key="sekret", admin_api_key="ops")
    assert_error(*(await cluster.post("/generate", {"text": "x"})), 401)
    assert_error(*(await cluster.post("/generate", {"text": "x"}, {"Authorization": "Bearer nope"})), 401)
    for path in ("/workers", "/v1/models"):
        async with cluster.client.get(cluster.url + path) as r:
            assert_error(r.status, await r.json(), 401)
    for key in (None, "sekret"):  # an admin route: the inference key does not open it
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with cluster.client.delete(cluster.url + "/workers/" + quote(cluster.decodes[0].url, safe=""),
                                         headers=headers) as r:
            assert r.status == 401
    for path in ("/health", "/metrics"):
        async with cluster.client.get(cluster.url + path) as r:
            assert r.status == 200
    status, _ = await cluster.post("/generate", {"text": "x"}, {"Authorization": "Bearer sekret"})
    assert status == 200
    # the key is forwarded to both legs as a bearer token
    assert cluster.prefills[0].requests[0].headers["Authorization"] == "Bearer sekret"
    assert cluster.decodes[0].requests[0].headers["Authorization"] == "Bearer sekret"


async def test_invalid_json_is_400(cluster):
    await cluster.start(1, 1)
    for data in (b"{not json", b"[1, 2]"):
        async with cluster.client.post(cluster.url + "/generate", data=data) as r:
            assert_error(r.status, await r.json(), 400)


# -- workers added and removed while serving ----------------------------------------------

async def test_dynamic_add_and_remove_while_requests_are_in_flight(cluster):
    await cluster.start(1, 1, decode_behavior=Behavior(delay_s=0.3), policy="round_robin")
    old_p, old_d = cluster.prefills[0], cluster.decodes[0]
    in_flight = [asyncio.ensure_future(cluster.post("/generate", {"text": f"a{i}"})) for i in range(10)]
    await wait_for(lambda: len(old_d.requests) == 10)
    new_p, new_d = StandinWorker("prefill"), StandinWorker("decode")
    await new_p.start()
    await new_d.start()
    cluster.prefills.append(new_p)
    cluster.decodes.append(new_d)
    for w in (new_p, new_d):
        async with cluster.client.post(cluster.url + "/workers", json={
                "url": w.url, "worker_type": w.role, "bootstrap_port": 9000}) as r:
            assert r.status == 200 and (await r.json())["healthy"] is True
    for w in (old_p, old_d):
        async with cluster.client.delete(cluster.url + "/workers/" + quote(w.url, safe="")) as r:
            assert r.status == 200
    # new requests go to the new pair only, the ones in flight finish on the old one
    after = await asyncio.gather(*(cluster.post("/generate", {"text": f"b{i}"}) for i in range(4)))
    before = await asyncio.gather(*in_flight)
    assert [s for s, _ in before + after] == [200] * 14
    assert old_d.completed == 10 and old_d.cancelled == []
    assert new_d.completed == 4 and len(new_p.requests) == 4
    assert new_p.requests[0].body["bootstrap_port"] == 9000
    async with cluster.client.get(cluster.url + "/workers") as r:
        workers = await r.json()
    assert [w["url"] for w in workers["decode"]] == [new_d.url]
    async with cluster.client.delete(cluster.url + "/workers/" + quote(old_d.url, safe="")) as r:
        assert_error(r.status, await r.json(), 404)
    async with cluster.client.post(cluster.url + "/workers", json={"url": new_d.url, "role": "decode"}) as r:
        assert r.status == 409
    async with cluster.client.post(cluster.url + "/workers", json={"url": "x", "role": "decode"}) as r:
        assert_error(r.status, await r.json(), 400)
