"""A prefill and a decode whose weights are quantized differently are refused at bootstrap, on both
sides, with a reason naming each side's quantization; equal quantization pairs as before."""

from __future__ import annotations

import pytest
from loop_stand import PDPair, reference

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("p_quant, d_quant", [("w8a16", "none"), ("none", "w8a16"), ("w8a8", "w8a16")])
def test_quantization_mismatch_is_refused_naming_both_sides(p_quant, d_quant):
    pair = PDPair(p_engine={"quantization": p_quant}, d_engine={"quantization": d_quant})
    try:
        pair.submit("a", [1, 2, 3, 4, 5], max_new=4)
        pair.run(pair.done("a"))
        want = f"weights quantization: prefill {p_quant}, decode {d_quant}"
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
