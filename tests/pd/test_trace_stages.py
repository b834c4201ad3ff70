"""The scheduler ranks' stage spans of one traced 1P1D request, exported by real servers.

Stand: a prefill and a decode server over Mooncake (TCP), both tracing to an OTLP receiver in
this process, and a tracing router in this process. A prompt longer than two 64-token chunks
(``--chunked-prefill-size 64``) must show one ``prefill.chunk`` span per chunk; both sides'
``*.kv_transfer`` spans carry the room's KV bytes (pages x page bytes); the decode shows its
preallocation, its first step and its sampled steps; every stage span is a child of its server's
``server.request`` span. A request whose client trace is not sampled exports no span at all.
"""

from __future__ import annotations

import random

import pytest
import requests
from support.pd_stand import InProcessRouter, Server, greedy_body, prompt_ids, serving

from pdserve.engine.sched.stage_recorder import DECODE_STEP_SAMPLE
from pdserve.router.config import RouterConfig, WorkerSpec

pytestmark = pytest.mark.timeout(600)

# the default model (docs/DESIGN.md): 30 layers, 3 KV heads of 64; fp32; 16-token pages; K and V
PAGE_SIZE = 16
PAGE_BYTES = 30 * 2 * 3 * 64 * 4 * PAGE_SIZE
PROMPT = 150  # chunks of 64, 64, 22
MAX_NEW = DECODE_STEP_SAMPLE + 4  # decode steps 0..18 after the prefill's token: 0, 16 and 18 kept


@pytest.fixture(scope="module")
def stand(otlp):
    trace = ("--enable-trace", "--otlp-traces-endpoint", otlp.endpoint)
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # the exporters send each batch after 0.1 s
    servers = {"P": Server("trace-P", "prefill", "--max-total-tokens", "2048", *trace, env=env),
               "D": Server("trace-D", "decode", "--max-total-tokens", "2048", *trace, env=env)}
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


def _post(router, ids, traceparent: str):
    r = requests.post(f"http://127.0.0.1:{router.port}/generate", json=greedy_body(ids, MAX_NEW),
                      headers={"traceparent": traceparent}, timeout=300)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == MAX_NEW


def test_stage_spans_of_one_1p1d_request(stand, otlp):
    P, D, router = stand
    rng = random.Random(42)
    trace_id, client_span = f"{rng.getrandbits(128):032x}", f"{rng.getrandbits(64):016x}"
    _post(router, prompt_ids(PROMPT, seed=4242), f"00-{trace_id}-{client_span}-01")
    spans = otlp.wait_for(trace_id, {"prefill.bootstrap_wait", "prefill.queue", "prefill.chunk", "prefill.kv_transfer",
                                     "decode.prealloc", "decode.kv_transfer", "decode.first_step", "decode.step",
                                     "stream"})
    by: dict[tuple[str, str], list] = {}
    for s in spans:
        by.setdefault((s.service, s.name), []).append(s)
    server = {role: by[f"pdserve-{role}", "server.request"] for role in ("prefill", "decode")}
    assert all(len(v) == 1 for v in server.values()), server
    for (service, name), group in by.items():
        if service != "pdserve-router" and name != "server.request":
            role = service.removeprefix("pdserve-")
            assert all(s.parent_span_id == server[role][0].span_id for s in group), (service, name)

    chunks = sorted(by["pdserve-prefill", "prefill.chunk"], key=lambda s: s.attributes["pdserve.chunk"])
    assert [c.attributes["pdserve.chunk_tokens"] for c in chunks] == [64, 64, PROMPT - 128]
    room_bytes = -(-PROMPT // PAGE_SIZE) * PAGE_BYTES
    for role in ("prefill", "decode"):
        (kv,) = by[f"pdserve-{role}", f"{role}.kv_transfer"]
        assert kv.attributes["pdserve.kv_bytes"] == room_bytes, role
        assert kv.attributes["pdserve.transfer_backend"] == "mooncake"
    (first,) = by["pdserve-decode", "decode.first_step"]
    assert first.attributes["pdserve.step"] == 0 and first.attributes["pdserve.decode_steps"] == MAX_NEW - 1
    assert sorted(s.attributes["pdserve.step"] for s in by["pdserve-decode", "decode.step"]) == [
        DECODE_STEP_SAMPLE, MAX_NEW - 2]
    assert ("pdserve-decode", "prefill.chunk") not in by, "the decode computed no prompt"
    P.wait_unleaked()
    D.wait_unleaked()


def test_an_unsampled_trace_exports_nothing(stand, otlp):
    P, D, router = stand
    rng = random.Random(7)
    unsampled, sampled = (f"{rng.getrandbits(128):032x}" for _ in range(2))
    _post(router, prompt_ids(40, seed=77), f"00-{unsampled}-{rng.getrandbits(64):016x}-00")
    # a sampled request after it: once its spans are in, the unsampled one's would have been too
    _post(router, prompt_ids(40, seed=78), f"00-{sampled}-{rng.getrandbits(64):016x}-01")
    otlp.wait_for(sampled, {"prefill.chunk", "decode.first_step"})
    assert otlp.of_trace(unsampled) == []
