"""A prefill and a decode whose weights are quantized differently, or that run different models of
one KV layout (two fine-tunes of one base), are refused at bootstrap, on both sides, with a reason
naming each side's; equal ones pair as before."""

from __future__ import annotations

import pytest
from support.loop_stand import PDPair, reference

pytestmark = pytest.mark.timeout(30)


A, B = "/models/finetune-a", "/models/finetune-b"  # EchoRunner's model identity is "echo PATH"


@pytest.mark.parametrize("field, p_value, d_value, want", [
    ("quantization", "w8a16", "none", "weights quantization: prefill w8a16, decode none"),
    ("quantization", "none", "w8a16", "weights quantization: prefill none, decode w8a16"),
    ("quantization", "w8a8", "w8a16", "weights quantization: prefill w8a8, decode w8a16"),
    ("model_path", A, B, f"model mismatch: prefill echo {A}, decode echo {B}"),
])
def test_mismatch_is_refused_naming_both_sides(field, p_value, d_value, want):
    pair = PDPair(p_engine={field: p_value}, d_engine={field: d_value})
    try:
        pair.submit("a", [1, 2, 3, 4, 5], max_new=4)
        pair.run(pair.done("a"))
        for side in "PD":
            out = pair.final(side, "a")
            assert out.finish_reason == "error" and want in out.error, (side, out)
        assert pair.tokens("a") == []
        pair.settle()
    finally:
        pair.close()


def test_equal_quantization_pairs():
    pair = PDPair(p_engine={"quantization": "w8a16"}, d_engine={"quantization": "w8a16"})
    try:
        pair.submit("a", [1, 2, 3, 4, 5], max_new=4)
        pair.run(pair.done("a"))
        assert pair.final("D", "a").finish_reason == "length"
        assert pair.tokens("a") == reference([1, 2, 3, 4, 5], 4)
        pair.settle()
    finally:
        pair.close()
