"""w8a16's larger products on AMX-BF16 over gemv's packed int8 (kernels/cpu_gemv.c,
``NativeKernels.w8_amx_linear``) against float64 products of the same operands: every epilogue,
float32 output, per-row and Q8_0 block scales, ragged M (tiles of 16 tokens, blocks of 256), N
(groups of 32 weight rows) and K (steps of 32, an odd K)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_executor.quantization import Int8Weight
from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.gemv_layout import GemvWeight

native = native_kernels()
pytestmark = pytest.mark.skipif(native is None or not native.has_w8_amx,
                                reason="needs AMX-BF16 (and AVX-512 gemv) and a C compiler")

SHAPES = [(960, 576), (130, 1536), (70, 33), (64, 64)]  # (N, K)


def _close(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, ulps: float = 1.0) -> None:
    # float32 sums of exact bf16 products, then one bf16 rounding: within ``ulps`` bf16 ulps of the
    # reference, plus float32's summation error where the sum cancels (mag: the products' magnitudes)
    tol = ulps * 2.0**-7 * ref.abs() + 2.0**-20 * mag
    assert ((out.double() - ref).abs() <= tol).all(), ((out.double() - ref).abs() / tol).max()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [5, 64, 300])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("blocked", [False, True])
def test_w8_amx_linear_every_epilogue(shape, rows, threads, blocked):
    n, k = shape
    if blocked and k % 32:
        pytest.skip("Q8_0's blocks are 32 columns")
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows * 1000 + n + blocked)
    q = Int8Weight.quantize((torch.randn(n, k, generator=g) / k**0.5).bfloat16())
    scale = q.scale
    if blocked:  # a scale per row and 32 columns, as a Q8_0 file keeps them
        scale = (q.scale[:, None] * (0.5 + torch.rand(n, k // 32, generator=g))).contiguous()
    full = torch.randn(rows + 3, k + 5, generator=g).bfloat16()
    x = full[1 : rows + 1, 2 : k + 2]  # a row stride of its own
    packed = GemvWeight.pack(q.q, scale=scale)
    # the weights the product multiplies: q times its row's scale after the sums, or (Q8_0) the
    # dequantized bf16(q * s), as gemv_dequantize rounds it
    w = native.gemv_dequantize(packed).double() if blocked else q.q.double() * scale.double()[:, None]
    ref, mag = x.double() @ w.T, x.double().abs() @ w.abs().T
    plain = native.w8_amx_linear(x, packed)
    _close(plain, ref, mag)
    res = torch.randn(rows, n, generator=g).bfloat16()
    _close(native.w8_amx_linear(x, packed, residual=res), ref + res.double(), mag)
    wide = native.w8_amx_linear(x, packed, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, plain.float())
    bias = torch.randn(n, generator=g).bfloat16()
    assert torch.equal(native.w8_amx_linear(x, packed, bias=bias), plain + bias)
    half = n // 2
    swiglu = native.w8_amx_linear(x, GemvWeight.pack(q.q[: 2 * half], swiglu=True, scale=scale[: 2 * half]))
    assert swiglu.shape == (rows, half)
    gate = torch.nn.functional.silu(ref[:, :half]).bfloat16().double()
    up = ref[:, half : 2 * half]
    # a gate near a rounding midpoint may round either way (one ulp, 2^-7 of it at the bottom of a
    # binade), then the product's own rounding
    tol = (2.0**-7 + 2.0**-8) * (gate * up).abs() + 2.0**-20 * (mag[:, half : 2 * half] * gate.abs()
                                                               + mag[:, :half] * up.abs())
    assert ((swiglu.double() - gate * up).abs() <= tol).all()
