"""KV events over real ZMQ sockets: the server's publisher to the router's subscriber, a late
subscriber recovering the batches it missed by replay, and bad streams that never crash it."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from pdserve.engine.mem_cache.kv_event_publisher import ZmqEventPublisher
from pdserve.engine.kv_events_config import KVEventsConfig
from pdserve.entrypoints.procs import free_port
from pdserve.engine.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from pdserve.router.kv.kv_index import KVIndex
from pdserve.router.kv.kv_subscriber import EventSource, KVEventSubscriber


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[0] * (2 * len(hashes)),
                       block_size=2, lora_id=None, medium="GPU")


def wait_for(cond, timeout: float = 10.0, tick=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        if tick is not None:
            tick()
        time.sleep(0.05)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def make_sub(ctx, **kw):
    index, lock = KVIndex(), threading.Lock()
    return index, KVEventSubscriber(index, lock, ctx=ctx, **kw)


def test_late_subscriber_replays_what_it_missed(ctx):
    pub_port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{pub_port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv")
    publisher = ZmqEventPublisher(cfg, dp_rank=0, ctx=ctx)
    index, sub = make_sub(ctx)
    try:
        # seq 0..2 go out before anyone subscribes: lost on the PUB socket, kept for replay
        publisher.publish([stored(1, 2)])
        publisher.publish([stored(3)])
        publisher.publish([BlockRemoved(block_hashes=[3], medium="GPU")])
        time.sleep(0.2)
        sub.add(EventSource("w0", cfg.endpoint, cfg.replay_endpoint, "kv"))
        probes = iter(range(100, 200))
        wait_for(lambda: index.holders(100), tick=lambda: publisher.publish([stored(next(probes))]))
        assert sub.counts["gaps"] == 1 and sub.counts["replays"] == 1 and sub.counts["dropped"] == 0
        assert index.holders(1) == {"w0"} and index.holders(2) == {"w0"} and not index.holders(3)
        publisher.publish([AllBlocksCleared()])
        wait_for(lambda: index.num_blocks("w0") == 0)
    finally:
        sub.close()
        publisher.close()


def test_gap_without_replay_drops_entries_and_bad_batches_are_counted(ctx):
    port = free_port()
    raw = ctx.socket(zmq.PUB)  # a hand-driven publisher: seq numbers and payloads of our choosing
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(f"tcp://127.0.0.1:{port}")
    index, sub = make_sub(ctx)

    def send(seq: int, events=None, payload: bytes | None = None, frames=None):
        body = payload if payload is not None else encode_batch(KVEventBatch(ts=0.0, events=events))
        raw.send_multipart(frames or [b"", seq.to_bytes(8, "big"), body])

    try:
        sub.add(EventSource("w0", "tcp://no-port-here"))  # a worker advertising nonsense: counted, skipped
        sub.add(EventSource("w1", f"tcp://127.0.0.1:{port}"))
        wait_for(lambda: index.holders(10), tick=lambda: send(0, [stored(10)]))
        assert sub.counts["bad_endpoint"] == 1
        sub.counts.clear()  # the probes above repeated seq 0: stale, not of interest
        send(1, [stored(11)])
        wait_for(lambda: index.holders(11))
        send(5, [stored(12)])  # 2..4 missed, no replay endpoint: w1's older entries go
        wait_for(lambda: index.holders(12))
        assert not index.holders(10) and not index.holders(11)
        assert sub.counts["gaps"] == 1 and sub.counts["dropped"] == 1
        send(3, [stored(13)])  # out of order (already past it): ignored
        send(6, payload=b"\xc1 not msgpack")  # undecodable: counted, w1's entries go
        send(7, frames=[b"", b"short"])  # a bad seq frame
        wait_for(lambda: sub.counts["malformed"] == 2)
        assert sub.counts["stale"] == 1 and not index.holders(13) and index.num_blocks("w1") == 0
        send(8, [stored(14)])
        wait_for(lambda: index.holders(14))
        send(0, [stored(15)])  # counting from 0 again: the worker restarted
        wait_for(lambda: index.holders(15))
        assert sub.counts["restarts"] == 1 and not index.holders(14)
    finally:
        sub.close()
        raw.close()


def test_silent_publisher_leaves_the_index(ctx):
    port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    publisher = ZmqEventPublisher(cfg, dp_rank=0, ctx=ctx)
    index, sub = make_sub(ctx, silence_timeout=0.3, replay_timeout=0.3)
    try:
        sub.add(EventSource("w2", cfg.endpoint, cfg.replay_endpoint))
        probes = iter(range(100, 200))
        wait_for(lambda: index.num_blocks("w2"), tick=lambda: publisher.publish([stored(next(probes))]))
        time.sleep(1.0)  # silent, but it answers the replay probe: kept
        assert index.num_blocks("w2") > 0 and sub.counts["silent"] == 0
        publisher.close()  # gone: the probe goes unanswered
        wait_for(lambda: sub.counts["silent"] == 1)
        assert index.num_blocks("w2") == 0
    finally:
        sub.close()
