"""Native gemv (kernels/cpu_gemv.c) against float32 products of the same bf16/int8 operands:
every epilogue, row counts across the 4-row passes, K not a multiple of the vector width,
N not a multiple of the 4-row blocks; for each instruction set this CPU runs (gemv_builds)."""

from __future__ import annotations

import platform

import pytest
import torch

from support.gemv_builds import gemv_builds
from pdserve.kernels.cpu_native import kernels_for
from pdserve.kernels.gemv_layout import GemvWeight

torch.set_num_threads(1)
BUILDS = gemv_builds()

SHAPES = [(960, 576), (77, 50), (6, 33)]  # (N, K): a model's, and ragged tails of both


def _bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # float32 sums in another order, then one bf16 rounding: within 2 bf16 ulps of the reference
    tol = 2 * 2.0**-8 * ref.abs() + 1e-3 * ref.abs().max()
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs() <= tol).all(), (out.float() - ref).abs().max()


@pytest.mark.parametrize("native", BUILDS)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_plain_residual_swiglu(rows, shape, native):
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    full = torch.randn(rows + 3, k, generator=g).bfloat16()
    x = full[1 : rows + 1]  # a row stride of its own
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    res = torch.randn(rows, n, generator=g).bfloat16()
    ref = x.float() @ w.float().T
    _bf16_close(native.gemv(x, GemvWeight.pack(w)), ref)
    _bf16_close(native.gemv(x, GemvWeight.pack(w), residual=res), ref + res.float())
    half = n // 2
    gate = ref[:, :half]
    # as the oneDNN post-ops round: silu(gate) to bf16, then times up
    swiglu = torch.nn.functional.silu(gate).bfloat16().float() * ref[:, half : 2 * half]
    _bf16_close(native.gemv(x, GemvWeight.pack(w[: 2 * half], swiglu=True)), swiglu)


@pytest.mark.parametrize("rows", [1, 3, 4, 6])
# blocked: GGUF Q8_0's scale per row and 32-column chunk (whole chunks only)
@pytest.mark.parametrize("shape, blocked", [*((s, False) for s in SHAPES), ((960, 576), True), ((77, 64), True)])
@pytest.mark.parametrize("native", BUILDS)
def test_int8_weights_with_scales(rows, shape, blocked, native):
    n, k = shape
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    if blocked:  # each chunk's sums scaled before they join the row's
        scale = torch.rand(n, k // 32, generator=g) / 100
        w = (q.float().view(n, -1, 32) * scale[:, :, None]).view(n, k)
    else:
        scale = torch.rand(n, generator=g) / 100
        w = q.float() * scale[:, None]
    ref = x.float() @ w.T
    _bf16_close(native.gemv(x, GemvWeight.pack(q, scale=scale)), ref)
    res = torch.randn(rows, n, generator=g).bfloat16()
    _bf16_close(native.gemv(x, GemvWeight.pack(q, scale=scale), residual=res), ref + res.float())
    half = n // 2
    swiglu = torch.nn.functional.silu(ref[:, :half]).bfloat16().float() * ref[:, half : 2 * half]
    packed = GemvWeight.pack(q[: 2 * half], swiglu=True, scale=scale[: 2 * half])
    _bf16_close(native.gemv(x, packed), swiglu)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 builds")
def test_instruction_set_chosen_at_build():
    # gemv's kernels are compiled for the instruction sets the build targets, absent without AVX2
    assert kernels_for("x86-64-v3").gemv_isa == "avx2"
    assert kernels_for("x86-64").has_gemv is False and kernels_for("x86-64").gemv_isa is None
