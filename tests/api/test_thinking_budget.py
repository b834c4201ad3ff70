"""The reasoning budget's matcher alone, on a toy vocabulary: what it allows while thinking, when it
forces the closing marker, and that an output which does not think is left alone."""

from __future__ import annotations

import torch

from pdserve.engine.constrained.thinking_budget import ThinkingBudget

VOCAB = ["<think>", "a", "b", "</", "think>", "ok", "x"]
END = [3, 4]  # "</" "think>"


def _decode(ids):
    return "".join(VOCAB[i] for i in ids)


def _allowed(m):
    mask = torch.zeros(1, 1, dtype=torch.int32)
    m.fill_mask(mask, 0)
    word = int(mask[0, 0]) & 0xFFFFFFFF
    return [t for t in range(len(VOCAB)) if (word >> t) & 1]


def test_forces_the_marker_after_the_budget():
    m = ThinkingBudget(None, END, "</think>", 3, _decode, start_text="<think>")
    for t in (0, 1, 2):
        assert _allowed(m) == list(range(len(VOCAB)))
        m.accept(t)
    assert _allowed(m) == [3]
    m.accept(3)
    assert _allowed(m) == [4]
    m.accept(4)
    assert _allowed(m) == list(range(len(VOCAB)))  # the answer is free


def test_a_marker_written_in_time_ends_the_budget():
    m = ThinkingBudget(None, END, "</think>", 4, _decode)  # the prompt opened the thinking
    for t in (1, 3, 4, 5, 6, 6):
        m.accept(t)
    assert _allowed(m) == list(range(len(VOCAB)))


def test_an_output_that_does_not_think_is_left_alone():
    m = ThinkingBudget(None, END, "</think>", 1, _decode, start_text="<think>")
    for t in (5, 6, 6):
        m.accept(t)
        assert _allowed(m) == list(range(len(VOCAB)))
