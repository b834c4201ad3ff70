"""The KV rooms' metrics of a prefill and a decode rank (``kvtransfer/room_metrics.py``), over the
real loops and managers in one process (``loop_stand``): bytes equal the rooms' KV size, the PD
queue gauges return to 0, and each failure counts under its cause on both sides. The
multi-process stand (``tests/pd/test_pd_observability.py``) checks the same through /metrics."""

from __future__ import annotations

import pytest
from support.loop_stand import LAYERS, PDPair

from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.kvtransfer.errors import FAILURE_CAUSES, failure_cause

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair(request):
    p = PDPair(**getattr(request, "param", {}))
    yield p
    p.close()


def value(loop, name: str, **labels) -> float:
    return loop.kv.metrics.registry.get_sample_value(name, labels) or 0.0


def side(loop) -> str:
    return loop.SIDE  # prefill | decode: the side label of the families both export


def rooms(loop, state: str, cause: str) -> float:
    return value(loop, "pdserve_kv_rooms_total", side=side(loop), state=state, cause=cause)


# chunk by chunk, and layer by layer (the layer-wise writes count the same bytes)
@pytest.mark.parametrize("pair", [{"p_engine": {"chunked_prefill_size": 8}},
                                  {"p_engine": {"chunked_prefill_size": 8}, "layerwise": True}], indirect=True)
def test_bytes_are_the_rooms_kv_and_the_queues_empty_out(pair):
    prompts = {"a": list(range(100, 111)), "b": list(range(300, 330)), "c": [7]}  # 3, 8 (4 chunks), 1 pages
    for rid, prompt in prompts.items():
        pair.submit(rid, prompt, max_new=3)
    pair.run(pair.done(*prompts))
    pair.settle()
    pool = pair.decode.pool
    # a page of a room: every layer's K and V for its page_size tokens
    page_bytes = 2 * LAYERS * pool.page_size * pool.layout().num_kv_heads * pool.layout().head_dim * 4
    kv_bytes = sum(pool.pages_for(len(p)) for p in prompts.values()) * page_bytes
    assert value(pair.prefill, "pdserve_kv_transfer_sent_bytes_total") == kv_bytes
    assert value(pair.decode, "pdserve_kv_transfer_received_bytes_total") == kv_bytes
    for loop in (pair.prefill, pair.decode):
        assert rooms(loop, "success", "none") == 3
        assert value(loop, "pdserve_kv_transfer_latency_seconds_count", side=side(loop)) == 3
        assert value(loop, "pdserve_kv_transfer_exposed_seconds_count", side=side(loop)) == 3
        # the exposed part is within the latency (sums over the same rooms)
        assert (value(loop, "pdserve_kv_transfer_exposed_seconds_sum", side=side(loop))
                <= value(loop, "pdserve_kv_transfer_latency_seconds_sum", side=side(loop)))
    p, d = pair.prefill.stats(), pair.decode.stats()
    assert (p.num_prefill_prealloc_queue_reqs, p.num_prefill_inflight_queue_reqs) == (0, 0)
    assert (d.num_decode_prealloc_queue_reqs, d.num_decode_transfer_queue_reqs, d.num_quarantine_pages) == (0, 0, 0)


def test_queue_gauges_while_requests_wait(pair):
    pair.submit("p-only", [1, 2, 3], to="P")  # waits in the bootstrap queue: no decode asks for it
    pair.submit("d-only", list(range(10, 20)), to="D")  # its destination waits at the prefill, unused
    pair.run(lambda: "d-only" in pair.decode.transfer)
    assert pair.prefill.stats().num_prefill_prealloc_queue_reqs == 1
    assert pair.decode.stats().num_decode_transfer_queue_reqs == 1
    pair.prefill.abort("p-only", "client left")
    pair.decode.abort("d-only", "client left")
    pair.run(pair.done("p-only", sides="P"))
    pair.run(pair.done("d-only", sides="D"))
    assert pair.prefill.stats().num_prefill_prealloc_queue_reqs == 0
    assert pair.decode.stats().num_decode_transfer_queue_reqs == 0
    assert rooms(pair.prefill, "failed", "aborted") == 1
    assert rooms(pair.decode, "failed", "aborted") == 1
    pair.settle()


def test_a_failed_write_counts_as_transfer_on_both_sides(pair):
    d_kv = pair.decode.kv
    v_last = d_kv.pool.buffer_infos()[-1].base_addr
    d_kv.engine.deregister(v_last)  # the write into it is refused
    pair.submit("f", list(range(60, 70)), max_new=4)
    pair.run(pair.done("f"))
    assert rooms(pair.prefill, "failed", "transfer") == 1
    assert rooms(pair.decode, "failed", "transfer") == 1
    assert value(pair.prefill, "pdserve_num_transfer_failed_reqs_total") == 1
    assert value(pair.prefill, "pdserve_kv_transfer_sent_bytes_total") == 0
    assert value(pair.decode, "pdserve_kv_transfer_received_bytes_total") == 0
    pair.run(lambda: pair.decode.stats().num_quarantine_pages == 0)  # released once the prefill closed it
    pair.settle()
    d_kv.engine.register(v_last, d_kv.pool.buffer_infos()[-1].nbytes)


def test_timeouts_count_under_their_cause(pair):
    pair.submit("lonely", [5, 6, 7], to="P")  # no decode ever asks for it
    pair.submit("w", list(range(10, 20)), max_new=3, to="D")  # the prefill never gets it
    pair.run(lambda: "w" in pair.decode.transfer, prefill=False)
    pair.clock.advance(pair.kv_config.waiting_timeout + pair.kv_config.bootstrap_timeout + 1)
    pair.run(pair.done("lonely", sides="P"))
    pair.run(pair.done("w", sides="D"))
    assert rooms(pair.prefill, "failed", "bootstrap_timeout") == 1
    assert value(pair.prefill, "pdserve_num_bootstrap_failed_reqs_total") == 1
    assert rooms(pair.decode, "failed", "waiting_timeout") == 1
    assert value(pair.decode, "pdserve_num_transfer_failed_reqs_total") == 1
    pair.settle()


def test_the_front_end_serves_each_ranks_families_with_its_ranks():
    pair = PDPair()
    try:
        pair.submit("a", [1, 2, 3, 4, 5], max_new=2)
        pair.run(pair.done("a"))
        m = ServerMetrics(dp_size=1, model_name="m")
        snap = pair.decode.rank_metrics()
        text = m.render([pair.decode.stats()], [0], {(0, 0): snap, (0, 1): snap})
    finally:
        pair.close()
    assert ('pdserve_kv_rooms_total{model_name="m",dp_rank="0",tp_rank="1",side="decode",state="success",'
            'cause="none"} 1.0') in text
    assert text.count("# TYPE pdserve_kv_transfer_received_bytes_total counter") == 1
    assert 'pdserve_num_decode_transfer_queue_reqs{model_name="m",dp_rank="0"} 0' in text
    assert ('pdserve_kv_transfer_exposed_seconds_bucket{model_name="m",dp_rank="0",tp_rank="0",side="decode",'
            'le="+Inf"} 1.0') in text


@pytest.mark.parametrize("reason, cause", [
    ("no destination from decode within bootstrap_timeout 4.0s", "bootstrap_timeout"),
    ("KV transfer failed: prefill not reachable within bootstrap_timeout 4.0s", "bootstrap_timeout"),
    ("no KV from prefill within waiting_timeout 20.0s", "waiting_timeout"),
    ("prefill dp 0 (bootstrap h:1) unreachable: no heartbeat reply from TP rank 0 for 3.1s", "peer_dead"),
    ("aborted by prefill: KV write of room 5 failed: mooncake batch write failed: injected transfer fault",
     "transfer"),
    ("transfer error: RuntimeError('x')", "transfer"),
    ("aborted by decode: aborted by decode: client left", "aborted"),
    # another TP rank's reason, carried by the agreement (and on to the peer)
    ("failed on TP rank 1 of this server: no KV from prefill within waiting_timeout 60.0s", "waiting_timeout"),
    ("aborted by decode: failed on TP rank 0 of this server: aborted by decode: client left", "aborted"),
    ("failed on another TP rank of this server", "other"),
    ("prefill ended the request: length", "aborted"),
    ("decode preallocated 2 pages for a 40-token prompt that needs 3", "rejected"),
    ("transfer backend mismatch: prefill nixl vs decode mooncake", "rejected"),
    ("something new", "other"),
])
def test_failure_causes(reason, cause):
    assert failure_cause(reason) == cause
    assert cause in FAILURE_CAUSES
