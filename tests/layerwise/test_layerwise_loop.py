"""Layer-wise KV send (``--disaggregation-layerwise``) through the real prefill and decode loops in
one process (``local`` transfers, ``loop_stand``): each layer leaves while the next computes, the
outputs equal the chunk-level ones, and a room failing between two layers frees its pages on both
sides. Both pools are checked after every step (``PDPair.step``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from loop_stand import LAYERS, PDPair, reference

from pdserve.kvtransfer.errors import TransferFailedError
from pdserve.kvtransfer.kv_poll import KVPoll
from pdserve.kvtransfer.engines.local_engine import LocalTransferEngine

pytestmark = pytest.mark.timeout(60)

CHUNKED = {"chunked_prefill_size": 8}
PROMPTS = {"one": list(range(100, 107)), "multi": list(range(200, 230))}  # 1 chunk; 4 chunks of 8


class LayerRecordingEngine(LocalTransferEngine):
    """The prefill's ``local`` engine, recording which layers each write carries; it can refuse
    the writes of one layer (``fail_layer``), as a link failing half-way through a room would."""

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__(host)
        self.pool = None  # set once the prefill pool exists: addresses -> layers
        self.writes: list[frozenset[int]] = []
        self.fail_layer: int | None = None
        self.changed = threading.Condition()

    def layers_of(self, src: Sequence[int]) -> frozenset[int]:
        infos = self.pool.buffer_infos()
        return frozenset(i % LAYERS for i, b in enumerate(infos) for a in src if b.base_addr <= a < b.base_addr + b.nbytes)

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              notify: bytes | None = None) -> None:
        layers = self.layers_of(src)
        if self.fail_layer in layers:
            raise TransferFailedError(self.name, "batch write", -1, f"injected failure of layer {self.fail_layer}")
        super().write(peer, src, dst, lengths, notify)
        with self.changed:
            self.writes.append(layers)
            self.changed.notify_all()

    def wait_written(self, layer: int, count: int, timeout: float = 5.0) -> bool:
        """Until ``count`` writes carried ``layer``."""
        with self.changed:
            return self.changed.wait_for(lambda: sum(layer in w for w in self.writes) >= count, timeout)


def make_pair(layerwise: bool, **kw) -> tuple[PDPair, LayerRecordingEngine]:
    engine = LayerRecordingEngine()
    pair = PDPair(p_engine=CHUNKED, p_transfer_engine=engine, layerwise=layerwise, **kw)
    engine.pool = pair.prefill.pool
    return pair, engine


def run_prompts(pair: PDPair) -> dict[str, list[int]]:
    for rid, prompt in PROMPTS.items():
        pair.submit(rid, prompt, max_new=4)
    pair.run(pair.done(*PROMPTS))
    pair.settle()
    return {rid: pair.tokens(rid) for rid in PROMPTS}


def test_layerwise_outputs_equal_chunk_level():
    outputs = {}
    for layerwise in (False, True):
        pair, engine = make_pair(layerwise)
        try:
            outputs[layerwise] = run_prompts(pair)
            kv_writes = [w for w in engine.writes if w]  # the aux write carries no layer
            # chunk-level: every write carries all layers (layer-wise may too, where the transfer
            # thread woke after both of these tiny layers: the next test pins the overlap down)
            assert kv_writes and (layerwise or all(w == set(range(LAYERS)) for w in kv_writes))
        finally:
            pair.close()
    assert outputs[True] == outputs[False] == {rid: reference(p, 4) for rid, p in PROMPTS.items()}


def test_a_layer_moves_while_the_next_one_computes():
    pair, engine = make_pair(True)
    forwards = 0

    def probe(layer: int) -> None:
        nonlocal forwards
        if layer == 0:
            forwards += 1
            # the forward is paused before layer 1: layer 0 of this step must get written meanwhile
            assert engine.wait_written(0, forwards), f"layer 0 of forward {forwards} not written during it"

    try:
        pair.prefill.runner.layer_probe = probe
        pair.submit("multi", PROMPTS["multi"], max_new=3)
        pair.run(pair.done("multi"))
        assert forwards == 4  # 30 tokens in chunks of 8
        assert pair.tokens("multi") == reference(PROMPTS["multi"], 3)
        # each forward: layer 0 alone (written while the forward waited), then layer 1; then the aux data
        assert engine.writes == [frozenset({0}), frozenset({1})] * 4 + [frozenset()]
        pair.settle()
    finally:
        pair.close()


def test_decode_abort_between_layers_frees_both_pools():
    pair, engine = make_pair(True)
    state = {"forwards": 0}

    def probe(layer: int) -> None:
        if layer != 0:
            return
        state["forwards"] += 1
        assert engine.wait_written(0, state["forwards"])  # layer by layer, as in the test above
        if state["forwards"] == 2:  # the second chunk: its layer 0 has left, layer 1 must not
            sender = pair.prefill.senders["multi"]
            assert pair.decode.abort("multi", "client left")
            deadline = time.monotonic() + 5
            while sender.state is not KVPoll.Failed:  # the AbortRoom reached the prefill's control thread
                assert time.monotonic() < deadline, "the decode's abort did not reach the prefill"
                time.sleep(0.001)

    try:
        pair.prefill.runner.layer_probe = probe
        pair.submit("multi", PROMPTS["multi"], max_new=3)
        pair.run(pair.done("multi"))
        assert pair.final("D", "multi").finish_reason == "abort"
        p = pair.final("P", "multi")
        assert p.finish_reason == "error" and "aborted by decode: client left" in p.error
        # layer 0 of chunks 1 and 2 and layer 1 of chunk 1 only: nothing after the abort
        assert engine.writes == [frozenset({0}), frozenset({1}), frozenset({0})]
        pair.settle()  # the decode's quarantine released by the prefill's RoomClosed; every page free
    finally:
        pair.close()


@pytest.mark.parametrize("rid", list(PROMPTS))
def test_a_write_failing_at_a_later_layer_fails_the_room_on_both_sides(rid):
    pair, engine = make_pair(True)
    engine.fail_layer = 1  # layer 0 lands, layer 1's write fails
    # layer 0 of the first chunk leaves on its own (the forward waits for it), as in the tests above
    pair.prefill.runner.layer_probe = lambda layer: layer == 0 and engine.wait_written(0, 1)
    try:
        pair.submit(rid, PROMPTS[rid], max_new=3)
        pair.run(pair.done(rid))
        p, d = pair.final("P", rid), pair.final("D", rid)
        assert p.finish_reason == "error" and "injected failure of layer 1" in p.error
        assert d.finish_reason == "error" and "KV transfer failed" in d.error
        assert engine.writes == [frozenset({0})]
        pair.settle()
    finally:
        pair.close()


def test_the_serve_flag_sets_the_kv_config():
    from pdserve.entrypoints.flags import parse_serve_args
    from pdserve.engine.kv_transfer_config import KVTransferConfig

    assert parse_serve_args([]).kv_transfer.layerwise is KVTransferConfig.layerwise
    assert parse_serve_args(["--disaggregation-layerwise"]).kv_transfer.layerwise is True
    assert parse_serve_args(["--no-disaggregation-layerwise"]).kv_transfer.layerwise is False
