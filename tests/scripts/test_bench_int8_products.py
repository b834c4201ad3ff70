"""scripts/bench_int8_products.py at a small size: every side runs the same shapes, and the
report has each side's figures and its ratio to bf16 (AMX's only where the CPU has AMX-INT8)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.kernels.cpu_int8_act import Int8ActKernels
from pdserve.kernels.cpu_native import native_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_int8_products  # noqa: E402

native = native_kernels()


@pytest.mark.skipif(native is None, reason="needs a C compiler")
def test_reports_every_side_against_bf16():
    result = bench_int8_products.main(["--threads", "1", "--rows", "40", "--repeats", "1"])
    sides = ["bf16", "int_mm"] + (["amx"] if Int8ActKernels(native).has_amx else [])
    assert result["amx"] == ("amx" in sides)
    for side in sides:
        times = [result[f"{side}_{name}_ms"] for name, *_ in bench_int8_products.SHAPES]
        assert all(t > 0 for t in times) and result[f"{side}_layer_ms"] == pytest.approx(sum(times), abs=0.01)
        assert side == "bf16" or result[f"{side}_vs_bf16"] > 0
