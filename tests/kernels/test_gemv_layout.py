"""The packed weight layout of native gemv (kernels/gemv_layout.py): packing round-trips on any
CPU, the bytes sit where cpu_gemv.c reads them, and the dense form of a packed int8 weight
(native where gemv runs, on each instruction set gemv_builds gives, torch elsewhere) is
Int8Weight.dequantize's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from support.gemv_builds import gemv_builds
from pdserve.engine.model_executor.quantization import Int8Weight, dense
from pdserve.kernels.gemv_layout import GemvWeight

BUILDS = gemv_builds()
SHAPES = [(960, 576), (78, 50), (6, 33), (2, 1)]  # (N, K): a model's, ragged rows and columns, tiny


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_unpack_round_trip(shape, swiglu):
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = GemvWeight.pack(w, swiglu)
    assert torch.equal(packed.unpack(), w) and (packed.rows, packed.cols, packed.swiglu) == (n, k, swiglu)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g)
    packed = GemvWeight.pack(q, swiglu, scale)
    assert torch.equal(packed.unpack(), q) and torch.equal(packed.scale, scale)
    # padded to whole blocks of 4 rows (per half) and chunks of 32 columns, nothing more
    rows_out = n // 2 if swiglu else n
    assert packed.data.numel() == (2 if swiglu else 1) * -(-rows_out // 4) * 4 * -(-k // 32) * 32


def test_packed_positions_are_the_kernels():
    # bf16: chunk 0 holds rows 0..3's columns 0..31, then chunk 1; SwiGLU: gate block 0, up block 0, gate block 1
    w = torch.arange(8 * 64).view(8, 64).bfloat16()
    data = GemvWeight.pack(w).data.view(-1, 4, 32)
    assert torch.equal(data[0], w[:4, :32]) and torch.equal(data[1], w[:4, 32:]) and torch.equal(data[2], w[4:, :32])
    data = GemvWeight.pack(w, swiglu=True).data.view(-1, 4, 32)
    assert torch.equal(data[0], w[:4, :32]) and torch.equal(data[2], w[4:, :32]) and torch.equal(data[1], w[:4, 32:])
    # int8, two's complement: per chunk rows (0, 1) then (2, 3), each pair 8 columns of one row, 8 of the other
    q = torch.tensor([[-1, 2] + [0] * 30, [3, -4] + [0] * 30, [5] + [0] * 31, [-127] + [0] * 31], dtype=torch.int8)
    q[0, 9] = 7  # column 9: the pair's second group of 8
    pair0, pair1 = GemvWeight.pack(q, scale=torch.ones(4)).data.view(torch.uint8).view(2, 64)
    assert pair0[:2].tolist() == [0xFF, 2] and pair0[8:10].tolist() == [3, 0xFC] and pair0[17] == 7
    assert pair0[18:].count_nonzero() == 0 and pair1[0] == 5 and pair1[8] == 0x81


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_of_packed_int8_is_dequantize(shape, swiglu):
    n, k = shape
    q = Int8Weight.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)).bfloat16())
    packed = GemvWeight.pack(q.q, swiglu, q.scale)
    for dtype in (torch.bfloat16, torch.float32):  # bf16: the native pass where gemv runs
        assert torch.equal(dense(packed, dtype).view(-1).view(torch.uint8),
                           q.dequantize(dtype).view(-1).view(torch.uint8)), dtype
    for build in BUILDS:  # each instruction set's native pass
        native = build.values[0]
        assert torch.equal(native.gemv_dequantize(packed), q.dequantize(torch.bfloat16)), build.id


@pytest.mark.parametrize("swiglu", [False, True])
def test_dense_of_packed_q8_0_is_dequantize(swiglu):
    # Q8_0: one scale per row and block of 32 columns, the dequantized weights rounded as q * d
    n, k = 70, 96
    g = torch.Generator().manual_seed(1)
    q = Int8Weight.from_q8_0(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                             torch.rand(n, k // 32, generator=g) / 50)
    want = (q.q.float().view(n, -1, 32) * q.scale[:, :, None]).view(n, k)
    assert torch.equal(q.dequantize(torch.float32), want)
    packed = GemvWeight.pack(q.q, swiglu, q.scale)
    assert packed.blocked and torch.equal(packed.unpack(), q.q)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(dense(packed, dtype), q.dequantize(dtype)), dtype
    for build in BUILDS:
        native = build.values[0]
        assert torch.equal(native.gemv_dequantize(packed), q.dequantize(torch.bfloat16)), build.id
