"""The layer-wise hand-off on its own: per-layer descriptors, and a transfer thread's wait on a
forward that completes, raises half-way, or never starts before shutdown."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.kvtransfer.layer_signal import Doorbell, LayerSignal
from pdserve.kvtransfer.page_runs import run_descriptors, slice_descriptors, split_by_layer

pytestmark = pytest.mark.timeout(30)

LAYERS = 3
SRC_BASES = [1_000_000 * (i + 1) for i in range(2 * LAYERS)]  # K of layers 0..2, then V
DST_BASES = [50_000_000 + 1_000_000 * i for i in range(2 * LAYERS)]


def test_split_by_layer_is_each_layers_own_descriptors():
    src_pages, dst_pages = [3, 4, 5, 9], [7, 8, 2, 3]
    whole = run_descriptors(src_pages, dst_pages, SRC_BASES, DST_BASES, 64)
    for layer, got in enumerate(split_by_layer(*whole, LAYERS)):
        k, v = layer, LAYERS + layer
        assert got == run_descriptors(src_pages, dst_pages, [SRC_BASES[k], SRC_BASES[v]],
                                      [DST_BASES[k], DST_BASES[v]], 64)
    # head slices (one descriptor per run per head): the same cut
    sliced = slice_descriptors(src_pages, dst_pages, SRC_BASES, DST_BASES, 64, 640, 1280, 1, 0, 2)
    parts = split_by_layer(*sliced, LAYERS)
    assert sum(len(p[0]) for p in parts) == len(sliced[0])
    assert sorted(a for p in parts for a in p[0]) == sorted(sliced[0])
    with pytest.raises(ValueError):
        split_by_layer([1, 2, 3], [1, 2, 3], [1, 1, 1], LAYERS)


def _consume(signal: LayerSignal, bell: Doorbell, stop: threading.Event, seen: list[int]) -> None:
    """What a transfer thread does with a layer-wise chunk: wait past what it sent, until all or the end."""
    sent = 0
    while sent < signal.num_layers:
        done = signal.wait_past(sent, bell, stop)
        if done == sent:
            return
        seen.append(done)
        sent = done


def _run(forward, stop: threading.Event | None = None) -> list[int]:
    bell, stop = Doorbell(), stop or threading.Event()
    signal = LayerSignal(LAYERS, torch.device("cpu"))
    signal.ring_on(bell)
    seen: list[int] = []
    t = threading.Thread(target=_consume, args=(signal, bell, stop, seen))
    t.start()
    try:
        forward(signal)
    finally:
        t.join(10)
        bell.close()
    assert not t.is_alive(), "the transfer thread still waits"
    return seen


def test_every_layer_reaches_the_transfer_thread():
    def forward(signal):
        with signal as after_layer:
            for i in range(LAYERS):
                after_layer(i)

    seen = _run(forward)
    assert seen[-1] == LAYERS and seen == sorted(set(seen))


def test_a_forward_that_raises_releases_the_waiting_thread():
    def forward(signal):
        with pytest.raises(RuntimeError), signal as after_layer:
            after_layer(0)
            raise RuntimeError("out of memory in layer 1")

    assert _run(forward) == [1]  # layer 0 only; then the thread gives up instead of waiting on


def test_shutdown_releases_a_thread_whose_forward_never_runs():
    stop = threading.Event()
    stop.set()
    assert _run(lambda signal: None, stop) == []
