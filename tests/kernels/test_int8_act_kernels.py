"""kernels/cpu_int8_act.c, the passes around w8a8's int8 products, against the same in torch ops
(quantization.quantize_rows and int8_linear's torch path), the w8a8 product against float, and
kernels/cpu_amx_int8.c (where the CPU has AMX-INT8) against the path it replaces there."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_executor.quantization import Int8Weight, dense, int8_linear, quantize_rows
from pdserve.kernels.amx_layout import AmxInt8Weight
from pdserve.kernels.cpu_int8_act import OUTLIER_SLOTS, OUTLIER_TAU, Int8ActKernels
from pdserve.kernels.cpu_native import native_kernels

torch.set_num_threads(1)
native = native_kernels()
pytestmark = pytest.mark.skipif(native is None, reason="needs a C compiler")
BF16_ULP = 2.0**-7  # relative spacing of bf16 numbers, an upper bound of one rounding's error x 2


@pytest.fixture(scope="module")
def act():
    return Int8ActKernels(native)


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 rows of very different magnitudes, one all zero, seen through a row stride > cols."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, cols + 8, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    wide[rows // 2] = 0
    return wide.to(torch.bfloat16)[:, :cols]


def test_quantize_rows_matches_torch_and_is_within_half_a_step(act):
    x = activations(70, 576, seed=1)  # 70 rows: the parallel loop
    q, scale, none = act.quantize_rows(x)
    q_ref, scale_ref, none_ref = quantize_rows(x)
    assert none is None and none_ref is None
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == (70,)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    diff = (q.int() - q_ref.int()).abs()
    # x * (127 / amax) may land on a tie .5 in one and just off it in the other
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    assert q.abs().max() == 127 and torch.equal(q[35], torch.zeros_like(q[35])) and scale[35] == 0
    x32 = x.float()
    assert ((q.float() * scale[:, None] - x32).abs() <= 0.5001 * scale[:, None]).all()


def test_outliers_leave_the_int8_row_exactly(act):
    K = 1536  # at most K / OUTLIER_TAU values of a row can exceed OUTLIER_TAU x its mean |x|
    x = activations(70, K, seed=6).float()
    gen = torch.Generator().manual_seed(7)
    rows = torch.arange(0, 70, 3)
    for i, r in enumerate(rows.tolist()):  # values far over the row's mean |x|, either sign
        n = OUTLIER_SLOTS + 4 if i == 0 else 1 + i % 6  # row 0: more than the slots
        cols = torch.randperm(K, generator=gen)[:n]
        x[r, cols] = x[r].abs().mean() * 200 * torch.sign(torch.randn(n, generator=gen))
    x = x.to(torch.bfloat16)
    q, scale, out = act.quantize_rows(x, OUTLIER_TAU)
    q_ref, scale_ref, dense_ref = quantize_rows(x, OUTLIER_TAU)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    assert (q.int() - q_ref.int()).abs().max() <= 1
    # the same values as the torch path's: the first OUTLIER_SLOTS of each row in column order
    dense = torch.zeros(70, K)
    for m in range(70):
        n = int(out.count[m])
        assert n == int((dense_ref[m] != 0).sum()) <= OUTLIER_SLOTS
        dense[m, out.idx[m, :n].long()] = out.val[m, :n]
    assert torch.equal(dense, dense_ref)
    big = dense != 0
    assert big[rows].any(dim=1).all() and not big[~torch.isin(torch.arange(70), rows)].any()
    assert int(out.count[0]) == OUTLIER_SLOTS  # row 0's last 4 stay in its int8 row, setting its scale
    assert (q[big] == 0).all() and (dense[big] == x.float()[big]).all()
    # the rest of each row keeps int8 steps of its own size, not the outliers'
    x32 = torch.where(big, 0.0, x.float())
    assert ((q.float() * scale[:, None] - x32).abs() <= 0.5001 * scale[:, None]).all()
    assert (scale[rows[1:]] * 127 < x.float()[rows[1:]].abs().amax(dim=1) / 20).all()


@pytest.mark.parametrize("mode", ["plain", "residual", "swiglu"])
def test_scale_products_match_torch_to_one_rounding(act, mode):
    gen = torch.Generator().manual_seed(2)
    M, N = 67, 256
    acc = torch.randint(-200_000, 200_000, (M, N), generator=gen, dtype=torch.int32)
    a_scale, w_scale = torch.rand(M, generator=gen) * 1e-3, torch.rand(N, generator=gen) * 1e-3
    residual = torch.randn(M, N, generator=gen).to(torch.bfloat16) if mode == "residual" else None
    got = act.scale_products(acc, a_scale, w_scale, residual, swiglu=mode == "swiglu")
    y = acc.float() * a_scale[:, None] * w_scale
    if mode == "swiglu":
        want = y[:, N // 2 :] * torch.nn.functional.silu(y[:, : N // 2]).to(torch.bfloat16).float()
    else:
        want = y if residual is None else y + residual.float()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_int8_linear_native_and_torch_paths_agree_and_approximate_float(act, swiglu, outliers):
    x = activations(80, 576, seed=3)
    x[40] = torch.randn(576).to(torch.bfloat16)  # no all-zero row: relative errors below
    gen = torch.Generator().manual_seed(4)
    if outliers:  # a massive activation in one channel of every other token, as LLMs have
        x[::2, 17] = x[::2].float().abs().amax(dim=1).to(torch.bfloat16) * 30
    w = Int8Weight.quantize(torch.randn(512, 576, generator=gen) * 0.05).transposed()
    native_out, torch_out = int8_linear(x, w, act, swiglu=swiglu), int8_linear(x, w, None, swiglu=swiglu)
    assert native_out.shape == torch_out.shape == (80, 256 if swiglu else 512)
    # the same int32 sums; activations may differ by one step at ties, each output by a rounding
    assert ((native_out.float() - torch_out.float()).norm(dim=1) <= 0.01 * torch_out.float().norm(dim=1)).all()
    y = x.float() @ w.dequantize(torch.float32).t()
    if swiglu:
        y = y[:, 256:] * torch.nn.functional.silu(y[:, :256])
    # per-token int8 of Gaussian rows: ~0.8% relative error per row (measured); 2% stated. With an
    # outlier, relative to the rest of the product: in int8 its step would be 30x the rest's
    # (~20% error), multiplied exactly it leaves the rest's int8 and the bf16 rounding
    rest = y
    if outliers and not swiglu:
        rest = y - x.float()[:, 17:18] * w.dequantize(torch.float32)[:, 17]
    err = (native_out.float() - y).norm(dim=1) / rest.norm(dim=1)
    assert err.max() <= 0.02, err.max()


def amx_position(n: torch.Tensor, k: torch.Tensor, rows: int, cols: int, swiglu: bool) -> torch.Tensor:
    """Where W[n, k] lies in an AmxInt8Weight, from amx_layout's description: blocks of 32 columns
    (SwiGLU: 16 gate, then the same 16 up), K / 64 steps each, a step's tile 16 rows (k % 64 / 4) x
    16 columns x 4 (k % 4)."""
    if swiglu:
        half = rows // 2
        tile, col = (n >= half).long(), n % half
        block, col = col // 16, col % 16
    else:
        block, tile, col = n // 32, n % 32 // 16, n % 16
    steps = -(-cols // 64)
    return ((((block * steps + k // 64) * 2 + tile) * 16 + k % 64 // 4) * 16 + col) * 4 + k % 4


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("shape", [(960, 576), (70, 130)])  # (N, K): and neither a multiple of a tile
def test_amx_layout_is_tdpbssd_operand_and_round_trips(shape, swiglu):
    N, K = shape
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    w = AmxInt8Weight.pack(q, torch.rand(N), swiglu)
    n, k = torch.meshgrid(torch.arange(N), torch.arange(K), indexing="ij")
    assert torch.equal(w.data[amx_position(n, k, N, K, swiglu)], q)
    padded = w.data.clone()
    padded[amx_position(n, k, N, K, swiglu)] = 0
    assert not padded.any()  # the rest is padding, zero
    assert torch.equal(w.unpack(), q)
    torch.testing.assert_close(dense(w, torch.float32), Int8Weight(q, w.scale).dequantize(torch.float32))


@pytest.mark.skipif(native is None or not Int8ActKernels(native).has_amx, reason="needs AMX-INT8")
@pytest.mark.parametrize("mode", ["plain", "residual", "swiglu"])
@pytest.mark.parametrize("shape", [(80, 576, 512), (37, 130, 70), (300, 1536, 96)])  # (M, K, N)
def test_amx_linear_is_the_int_mm_path_bit_for_bit(act, mode, shape):
    """Product, outliers and scaling in one call: the same values as quantize_rows, torch._int_mm
    and scale_products, with rows, columns and K that fill no whole tile."""
    M, K, N = shape
    x = activations(M, K, seed=8)
    x[::3, 5] = x[::3].float().abs().amax(dim=1).to(torch.bfloat16) * 40  # outliers, every third row
    x[1, torch.arange(OUTLIER_SLOTS + 4) * 3] = 1e3  # K = 1536: more outliers than the slots in one row
    gen = torch.Generator().manual_seed(9)
    w = Int8Weight.quantize(torch.randn(N, K, generator=gen))
    residual = torch.randn(M, N, generator=gen).to(torch.bfloat16) if mode == "residual" else None
    swiglu = mode == "swiglu"
    counts = act.quantize_rows(x, OUTLIER_TAU)[2].count
    every_third = [r for r in range(0, M, 3) if r != M // 2]  # row M / 2 is all zero
    assert counts[every_third].min() >= 1 and (K < 1536 or counts[1] == OUTLIER_SLOTS)
    want = int8_linear(x, w.transposed(), act, residual, swiglu)
    got = int8_linear(x, AmxInt8Weight.pack(w.q, w.scale, swiglu), act, residual, swiglu)
    assert got.shape == want.shape and torch.equal(got, want)
