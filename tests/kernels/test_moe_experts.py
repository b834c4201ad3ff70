"""The routed experts (kernels/cpu_moe.c and its torch fallback in kernels/cpu_moe.py) against a
plain per-token, per-expert loop in float64: bf16 and float32, 1 to 8 experts a token, ragged
loads (experts with many tokens, with none, slots routed nowhere), shapes off the kernel's
blocks, 1 and 2 threads; each instruction set this CPU runs (AVX-512 BF16, and the portable
loops of an x86-64-v3 build)."""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve.kernels.cpu_moe import MoeKernels, fused_experts, fused_experts_torch
from pdserve.kernels.cpu_native import cpu_flags, kernels_for, native_kernels

E, H, INTER = 12, 80, 41  # H not a multiple of 32 nor of the 16-column blocks; INTER odd


def _paths() -> list:
    native = native_kernels()
    paths = [pytest.param(None, id="torch")]
    if native is not None:
        kernels = MoeKernels(native)
        paths.append(pytest.param(kernels, id=kernels.isa))
        if kernels.isa == "avx512" and {"avx2", "fma"} <= cpu_flags():
            portable = MoeKernels(kernels_for("x86-64-v3"))
            assert portable.isa == "portable"
            paths.append(pytest.param(portable, id="portable"))
    return paths


def _problem(T: int, K: int, dtype: torch.dtype, seed: int):
    """x [T, H] seen through a row stride > H, weights, and routing where expert 0 takes most
    tokens, experts 5 and 9 none, and every seventh slot goes nowhere (id -1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H + 6, generator=g).to(dtype)[:, 3 : H + 3]
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(dtype)
    pool = torch.tensor([e for e in range(E) if e not in (5, 9)])
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)])  # [T, K] distinct
    ids[torch.rand(T, generator=g) < 0.6, 0] = 0
    ids.view(-1)[::7] = -1
    weights = torch.rand(T, K, generator=g).softmax(-1)
    return x, w13, w2, ids, weights


def _reference(x, w13, w2, ids, weights) -> torch.Tensor:
    """float64 sum over each token's slots, the products rounded where a torch linear in x's
    dtype rounds them (gate, up, silu, their product, down)."""
    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(x.dtype).double()

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            xt = x[t].double()
            gate, up = r(w13[e, :INTER].double() @ xt), r(w13[e, INTER:].double() @ xt)
            act = r(r(torch.nn.functional.silu(gate)) * up)
            out[t] += float(weights[t, k]) * r(w2[e].double() @ act)
    return out


@functools.cache
def _case(T: int, K: int, dtype: torch.dtype):
    """(problem, its reference), computed once for every path and thread count."""
    problem = _problem(T, K, dtype, seed=T * 10 + K)
    return problem, _reference(*problem)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kernels", _paths())
def test_experts_match_a_plain_loop(kernels, dtype, K, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for T in (1, 3, 37):  # a decode token, a few, and blocks of 4 tokens with a remainder
            (x, w13, w2, ids, weights), ref = _case(T, K, dtype)
            out = fused_experts(x, w13, w2, ids, weights, kernels)
            assert out.shape == (T, H) and out.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
            else:  # sums in another order: a rounding of act may flip by one bf16 step
                err = (out.double() - ref).abs()
                assert (err <= 2 * 2.0**-8 * ref.abs() + 2e-3 * ref.abs().max()).all(), float(err.max())
            routed = (ids >= 0).any(-1)
            assert (out[~routed] == 0).all() and (out[routed].abs().sum(-1) > 0).all()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kernels", _paths())
def test_no_rows_give_no_rows(kernels, dtype):
    """An expert-parallel rank that received no slots in a step runs its experts on 0 rows."""
    x, w13, w2, ids, weights = _problem(1, 2, dtype, seed=2)
    out = fused_experts(x[:0], w13, w2, ids[:0], weights[:0], kernels)
    assert out.shape == (0, H) and out.dtype == dtype


@pytest.mark.parametrize("kernels", _paths())
def test_an_id_past_the_experts_is_refused(kernels):
    x, w13, w2, ids, weights = _problem(4, 2, torch.float32, seed=1)
    ids[2, 1] = E
    with pytest.raises(ValueError, match="below the 12 experts"):
        fused_experts(x, w13, w2, ids, weights, kernels)


def test_native_and_torch_paths_agree_in_bf16():
    native = native_kernels()
    if native is None:
        pytest.skip("needs a C compiler")
    x, w13, w2, ids, weights = _problem(64, 8, torch.bfloat16, seed=3)
    a = MoeKernels(native).experts(x, w13, w2, ids, weights).float()
    b = fused_experts_torch(x, w13, w2, ids, weights).float()
    assert ((a - b).abs() <= 2 * 2.0**-8 * b.abs() + 2e-3 * b.abs().max()).all()
