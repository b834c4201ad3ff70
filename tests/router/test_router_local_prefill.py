"""The conditional-disaggregation rule (router/local_prefill.py): pure, over numbers."""

from __future__ import annotations

from pdserve.router.config import RouterConfig
from pdserve.router.cli import build_parser, config_from_args
from pdserve.router.local_prefill import LocalReason, local_prefill_reason

SHORT, QUEUE = LocalReason.SHORT, LocalReason.QUEUE


def reason(uncached=None, max_tokens=0, loads=(0,), threshold=0, decode_local=0):
    return local_prefill_reason(uncached, max_tokens, list(loads), threshold, decode_local)


def test_short_counts_the_uncached_part_only():
    assert reason(uncached=64, max_tokens=64) is SHORT
    assert reason(uncached=65, max_tokens=64) is None
    assert reason(uncached=0, max_tokens=64) is SHORT  # all cached on the decode worker
    assert reason(uncached=None, max_tokens=64) is None  # not tokenized: the prefill path
    assert reason(uncached=10, max_tokens=0) is None  # off


def test_queue_rule_needs_every_prefill_queue_above_and_decode_room():
    assert reason(uncached=2000, max_tokens=64, loads=(5, 6), threshold=4) is QUEUE
    assert reason(uncached=None, loads=(5, 6), threshold=4) is QUEUE  # without a tokenizer too
    assert reason(uncached=2000, max_tokens=64, loads=(5, 4), threshold=4) is None  # one at the threshold
    assert reason(loads=(5, 6), threshold=4, decode_local=4) is None  # the decode worker is as busy
    assert reason(loads=(5, 6), threshold=4, decode_local=3) is QUEUE
    assert reason(loads=(), threshold=4) is None  # no healthy prefill: the path raises its 503
    assert reason(loads=(50,), threshold=0) is None  # off
    assert reason(uncached=3, max_tokens=64, loads=(50,), threshold=4) is SHORT  # short wins


def test_prefill_queue_threshold_flag():
    cfg = config_from_args(build_parser().parse_args(
        ["--prefill", "http://p:1", "--decode", "http://d:2", "--prefill-queue-threshold", "3"]))
    assert cfg.prefill_queue_threshold == 3 and RouterConfig().prefill_queue_threshold == 0


async def test_full_prefill_queues_send_a_request_to_the_decode_worker_alone(cluster):
    """The router's path, on stand-in workers: two slow prefills fill the queue (threshold 1),
    so the third request goes local; once they are answered, requests go remote again."""
    import asyncio

    from support.standin_worker import Behavior

    await cluster.start(1, 1, prefill_behavior=Behavior(delay_s=1.0), policy="round_robin",
                        prefill_queue_threshold=1)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    slow = [asyncio.ensure_future(cluster.post("/generate", body)) for _ in range(2)]
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    while len(prefill.requests) < 2:
        await asyncio.sleep(0.01)
    status, _ = await cluster.post("/generate", body)
    assert status == 200 and len(prefill.requests) == 2
    assert "bootstrap_room" not in decode.requests[-1].body  # a local prefill: no PD fields
    assert [s for s, _ in await asyncio.gather(*slow)] == [200, 200]
    await cluster.post("/generate", body)
    assert len(prefill.requests) == 3  # the queue is empty again: the prefill path
    metrics = cluster.router.metrics.render().decode()
    assert 'pdserve_router_local_prefill_decisions_total{reason="queue"} 1.0' in metrics
    assert 'pdserve_router_prefills_total{mode="local"} 1.0' in metrics


async def test_router_shutdown_stops_the_kv_event_subscriber(cluster):
    import threading

    def subscribers() -> int:
        return sum(t.name == "pdserve-kv-subscriber" and t.is_alive() for t in threading.enumerate())

    before = subscribers()
    await cluster.start(1, 1, prefill_policy="kv_aware")
    assert subscribers() == before + 1
    await cluster.close()
    assert subscribers() == before
