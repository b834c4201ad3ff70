"""Native bf16 products over panel-packed weights (kernels/cpu_gemm.c) against float32 products of
the same bf16 operands: every epilogue, float32 output, row counts across the 6-row passes and
the blocks of rows that stay in L2, panels split between threads, odd K, N not a multiple of the
64-row panels; and the packing itself."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.gemm_layout import PanelWeight

native = native_kernels()
pytestmark = pytest.mark.skipif(native is None or not native.has_gemm,
                                reason="needs AVX-512 BF16 (without AMX) and a C compiler")

SHAPES = [(960, 576), (130, 1536), (70, 33), (2, 2)]  # (N, K): a model's; ragged panels, odd K, a tiny one


def _close(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> None:
    # float32 sums of exact bf16 products in another order, then one bf16 rounding: within one
    # bf16 ulp of the reference, plus float32's summation error where the sum cancels (mag: the
    # sum of the products' magnitudes)
    tol = 2.0**-7 * ref.abs() + 2.0**-20 * mag
    assert ((out.float() - ref).abs() <= tol).all(), ((out.float() - ref).abs() / tol).max()


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_round_trips(shape):
    n, k = shape
    w = torch.randn(n, k).bfloat16()
    assert torch.equal(PanelWeight.pack(w).unpack(), w)
    assert torch.equal(PanelWeight.pack(w, swiglu=True).unpack(), w)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 7, 64, 300])
@pytest.mark.parametrize("shape", SHAPES)
def test_plain_residual_swiglu_float_out(rows, shape, threads):
    torch.set_num_threads(threads)
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    full = torch.randn(rows + 3, k + 5, generator=g).bfloat16()
    x = full[1 : rows + 1, 2 : k + 2]  # row stride of its own, rows not 4-byte aligned
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    res = torch.randn(rows, n, generator=g).bfloat16()
    ref, mag = x.float() @ w.float().T, x.float().abs() @ w.float().abs().T
    packed = PanelWeight.pack(w)
    plain = native.gemm(x, packed)
    _close(plain, ref, mag)
    _close(native.gemm(x, packed, residual=res), ref + res.float(), mag)
    bias = torch.randn(n, generator=g).bfloat16()
    _close(native.gemm(x, packed, residual=res, bias=bias), ref + bias.float() + res.float(), mag)
    wide = native.gemm(x, packed, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, plain.float())  # the same values, not re-rounded
    half = n // 2
    # as the oneDNN post-ops round: silu(gate) to bf16, then times up
    gate = torch.nn.functional.silu(ref[:, :half]).bfloat16().float()
    swiglu = native.gemm(x, PanelWeight.pack(w[: 2 * half], swiglu=True))
    assert swiglu.shape == (rows, half)
    # silu from an exp within 1e-7 of libm's, rounded to bf16: one ulp of the gate either way,
    # plus the float32 summation error of up's and gate's cancelling sums
    up, mag_gate, mag_up = ref[:, half : 2 * half], mag[:, :half], mag[:, half : 2 * half]
    tol = 2.0**-7 * (gate * up).abs() + 2.0**-20 * (mag_up * gate.abs() + mag_gate * up.abs())
    assert ((swiglu.float() - gate * up).abs() <= tol).all()
