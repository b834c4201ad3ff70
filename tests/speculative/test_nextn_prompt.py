"""The prefill's MTP over the prompt (``engine/speculative/nextn_prompt.py``), its pure parts: which
rows of a prefill step it runs, and its place around the forward (after it, its pool layer marked
done last on a layer-wise send's real ``LayerSignal``; nothing after a forward that raised)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from pdserve.engine.speculative.nextn_prompt import prompt_rows, then_mtp
from pdserve.kvtransfer.layer_signal import Doorbell, LayerSignal


def test_prompt_rows_are_those_whose_next_token_is_in_the_prompt():
    # prompts of 9, 14 and 5 tokens; the second's first chunk of 8, the third's last chunk of its one token
    rows = prompt_rows([9, 14, 5], [0, 0, 4], [9, 8, 1])
    assert [(r.index, r.row, r.start, r.count) for r in rows] == [(0, 0, 0, 8), (1, 9, 0, 8)]
    assert [(r.row, r.start, r.count) for r in prompt_rows([14], [8], [6])] == [(0, 8, 5)]
    assert prompt_rows([1], [0], [1]) == []  # a one-token prompt: its one row needs the first token


def test_the_mtp_runs_after_the_forward_and_its_layer_is_marked_last():
    signal, bell = LayerSignal(3, torch.device("cpu")), Doorbell()
    signal.ring_on(bell)
    seen = []
    try:
        with then_mtp(signal, lambda: seen.append(("mtp", signal.done)), 2) as after_layer:
            for layer in range(2):  # the model's two layers
                after_layer(layer)
                seen.append(("layer", signal.done))
            assert not signal.ended
        assert seen == [("layer", 1), ("layer", 2), ("mtp", 2)]
        assert signal.done == 3 and signal.ended
        assert signal.wait_past(2, bell, threading.Event()) == 3
    finally:
        bell.close()


def test_a_forward_that_raised_runs_no_mtp_and_leaves_its_layer_undone():
    signal, ran = LayerSignal(3, torch.device("cpu")), []
    with pytest.raises(RuntimeError, match="forward failed"):
        with then_mtp(signal, lambda: ran.append(True), 2) as after_layer:
            after_layer(0)
            raise RuntimeError("forward failed")
    assert ran == [] and signal.ended and signal.done == 1  # its rooms fail rather than wait


def test_without_a_layerwise_send_the_mtp_still_runs():
    ran = []
    with then_mtp(contextlib.nullcontext(), lambda: ran.append(True), 2) as after_layer:
        assert after_layer is None
    assert ran == [True]
