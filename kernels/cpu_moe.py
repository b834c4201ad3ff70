"""A mixture-of-experts layer's routed experts: ``fused_experts`` over the native kernel
(``cpu_moe.c``, compiled into the native library by ``cpu_native.py``) where it is built, else
the same computation in torch ops (``fused_experts_torch``), grouped by expert likewise.

Both compute, for tokens x [T, H] routed to K experts each (ids [T, K], weights [T, K]):
``out[t] = sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
w13 [E, 2 I, H] (each expert's gate rows, then its up rows) and w2 [E, H, I]; an id < 0 adds
nothing (a slot routed to no expert held here). Products are rounded to the model dtype as a
torch linear rounds them; the sum over a token's experts is float32, rounded once.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_native import NativeKernels

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class MoeKernels:
    """The bound ``moe_experts`` of one native library."""

    def __init__(self, native: NativeKernels):
        self._experts = native.lib.moe_experts
        self._experts.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _I32, _I32, _I32, _I64, _I64, _I32]
        self._experts.restype = ctypes.c_int
        # "avx512": bf16 products on AVX-512 BF16; "portable": loops the compiler vectorizes
        self.isa = "avx512" if native.lib.moe_isa() == 512 else "portable"

    def experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum for each row of ``x`` (module docstring): a new [T, H] of x's dtype.
        x: [T, H] bf16 or float32, rows contiguous (row stride free); w13, w2 contiguous, x's dtype;
        ids: [T, K] integer; weights: [T, K]."""
        T, H = x.shape
        E, I2, _ = w13.shape
        assert x.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1
        assert w13.dtype == w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous()
        assert w13.shape == (E, I2, H) and w2.shape == (E, H, I2 // 2) and ids.shape == weights.shape
        if T == 0:  # an EP rank that received no slots: an empty tensor's data pointer is NULL
            return torch.empty(0, H, dtype=x.dtype)
        ids = ids.to(torch.int32).contiguous()  # [T, K]
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(T, H, dtype=x.dtype)
        rc = self._experts(x.data_ptr(), x.stride(0), w13.data_ptr(), w2.data_ptr(), ids.data_ptr(),
                           weights.data_ptr(), out.data_ptr(), T, ids.shape[1], E, H, I2 // 2,
                           int(x.dtype == torch.bfloat16))
        if rc == -1:
            raise ValueError(f"expert ids must be below the {E} experts, got {int(ids.max())}")
        if rc != 0:
            raise RuntimeError(f"native MoE experts failed with code {rc}")
        return out


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    """``MoeKernels.experts`` in torch ops (any device and dtype): one gather and three products
    per expert that received tokens. Returns a new [T, H] of x's dtype."""
    T, H = x.shape
    E, I2, _ = w13.shape
    inter = I2 // 2
    K = ids.shape[1]
    flat = ids.reshape(-1)  # [T K] slots, slot s belongs to token s // K
    if flat.numel() and int(flat.max()) >= E:
        raise ValueError(f"expert ids must be below the {E} experts, got {int(flat.max())}")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(min=-1) + 1, minlength=E + 1).tolist()  # [E + 1]: bin 0 holds ids < 0
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    start = counts[0]
    for e in range(E):
        n = counts[e + 1]
        if n == 0:
            continue
        slots = order[start : start + n]  # [n]
        start += n
        tok = slots // K
        gu = F.linear(x[tok], w13[e])  # [n, 2 I]
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [n, I]
        y = F.linear(act, w2[e])  # [n, H]
        out.index_add_(0, tok, y.float() * weights.reshape(-1)[slots, None].float())
    return out.to(x.dtype)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  kernels: MoeKernels | None) -> torch.Tensor:
    """The native kernel where ``kernels`` is given and x lies on the CPU in bf16 or float32,
    else ``fused_experts_torch``."""
    if kernels is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32):
        return kernels.experts(x, w13, w2, ids, weights)
    return fused_experts_torch(x, w13, w2, ids, weights)
