"""Bindings of ``cpu_int8_act.c`` and ``cpu_amx_int8.c`` (compiled into the native library by
``cpu_native.py``): the per-token int8 quantization of activations, the scaling of int8 products
for ``w8a8``, and on AMX CPUs the int8 products with their scaling in one call."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pdserve.kernels.amx_layout import KSTEP, ROWS, AmxInt8Weight
from pdserve.kernels.cpu_native import NativeKernels

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

# Activation outliers: a value over OUTLIER_TAU x the mean |x| of its token's row is multiplied
# exactly rather than in int8 (at most OUTLIER_SLOTS a row, the first in column order). w8a8's
# perplexity over bf16 on the default model's 522-token text (Emerald Rapids), tau / slots:
# none +5.0 %; 20 / 8 +1.6 %; 20 / 32 +0.95 % (0.7 outliers a token, at most 17); 10 / 32 +0.14 %
# (2.8 a token), 10 / 128 +0.11 %. w8a16: +0.4 %. An 8 x 512-token prefill's scaling passes took
# 0.05 s more at 20 (of 3.2 s), 0.25 s more at 10: 20 meets the 2 % bar at a fifth of the cost.
OUTLIER_TAU = 20.0
OUTLIER_SLOTS = 32


@dataclass(frozen=True)
class Outliers:
    """A token's activation values kept out of its int8 row: ``idx`` [M, P] int32 columns,
    ``val`` [M, P] float32 values, ``count`` [M] int32 (row m's first ``count[m]`` slots)."""

    idx: torch.Tensor
    val: torch.Tensor
    count: torch.Tensor


class Int8ActKernels:
    def __init__(self, native: NativeKernels):
        lib = native.lib
        self._quant = lib.quant_rows_s8
        self._quant.argtypes = [_P, _I64, _P, _I64, _P, _I32, _I32, _F32, _I32, _P, _P, _P]
        self._quant.restype = ctypes.c_int
        self._epilogue = lib.int8_epilogue_bf16
        self._epilogue.argtypes = [_P, _P, _P, _P, _I64, _P, _I64, _I32, _I32, _I32, _P, _P, _P, _P, _I32]
        self._epilogue.restype = ctypes.c_int
        self._amx = lib.amx_int8_linear_bf16
        self._amx.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I32, _I32, _I32, _I32, _P, _P, _P, _I32]
        self._amx.restype = ctypes.c_int
        # AMX-INT8 here (and Linux's permission for its tiles): w8a8's weights are packed for it
        self.has_amx = bool(lib.amx_int8_supported())

    def quantize_rows(self, x: torch.Tensor, tau: float = 0.0,
                      for_amx: bool = False) -> tuple[torch.Tensor, torch.Tensor, Outliers | None]:
        """Symmetric per-row int8 of ``x`` [M, K] bf16 (row stride free): q [M, K] int8 and
        scale [M] float32, ``x[m] ~= q[m] * scale[m]`` with ``scale = max|x[m]| / 127``; with
        ``tau`` > 0, the row's values over ``tau`` x its mean |x| (up to OUTLIER_SLOTS) left out
        of q and its scale and returned as Outliers. ``for_amx``: q is the A operand of
        ``amx_linear``, zero padded to [ceil32(M), ceil64(K)] (amx_layout's ROWS, KSTEP)."""
        M, K = x.shape
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1
        shape = (-(-M // ROWS) * ROWS, -(-K // KSTEP) * KSTEP) if for_amx else (M, K)
        q = torch.empty(shape, dtype=torch.int8)
        q[M:].zero_()  # the padding, if any: the quantization writes the rest
        q[:M, K:].zero_()
        scale = torch.empty(M, dtype=torch.float32)
        out = None
        if tau > 0:
            out = Outliers(torch.empty(M, OUTLIER_SLOTS, dtype=torch.int32),
                           torch.empty(M, OUTLIER_SLOTS, dtype=torch.float32), torch.empty(M, dtype=torch.int32))
        rc = self._quant(x.data_ptr(), x.stride(0), q.data_ptr(), q.stride(0), scale.data_ptr(), M, K, tau,
                         OUTLIER_SLOTS,
                         *((out.idx.data_ptr(), out.val.data_ptr(), out.count.data_ptr()) if out else (None,) * 3))
        if rc != 0:
            raise RuntimeError(f"native int8 quantization failed with code {rc}")
        return q, scale, out

    def scale_products(self, acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                       residual: torch.Tensor | None = None, swiglu: bool = False,
                       outliers: Outliers | None = None, wt: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 ``acc[m, n] * a_scale[m] * w_scale[n]`` of int32 sums ``acc`` [M, N] (contiguous):
        plus ``residual`` [M, N] bf16 before the one rounding, or with ``swiglu`` (columns
        gate | up) ``up * bf16(silu(gate))``, [M, N / 2]. ``outliers`` (quantize_rows'), with
        ``wt`` [K, N] int8 contiguous (the weights transposed): their products join each row's
        sums before the scaling."""
        M, N = acc.shape
        assert acc.dtype == torch.int32 and acc.is_contiguous() and not (swiglu and residual is not None)
        o_ptrs = (None,) * 4
        if outliers is not None:
            assert wt is not None and wt.dtype == torch.int8 and wt.is_contiguous() and wt.shape[1] == N
            assert outliers.idx.shape == (M, OUTLIER_SLOTS)
            o_ptrs = (wt.data_ptr(), outliers.idx.data_ptr(), outliers.val.data_ptr(), outliers.count.data_ptr())
        for s, n in ((a_scale, M), (w_scale, N)):
            assert s.dtype == torch.float32 and s.is_contiguous() and s.numel() == n
        out = torch.empty(M, N // 2 if swiglu else N, dtype=torch.bfloat16)
        res_ptr, res_stride = None, 0
        if residual is not None:
            assert residual.dtype == torch.bfloat16 and residual.shape == (M, N) and residual.stride(1) == 1
            res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
        mode = 2 if swiglu else 1 if residual is not None else 0
        rc = self._epilogue(acc.data_ptr(), a_scale.data_ptr(), w_scale.data_ptr(), out.data_ptr(), out.stride(0),
                            res_ptr, res_stride, M, N, mode, *o_ptrs, OUTLIER_SLOTS)
        if rc != 0:
            raise RuntimeError(f"native int8 scaling failed with code {rc}")
        return out

    def amx_linear(self, x: torch.Tensor, w: AmxInt8Weight, residual: torch.Tensor | None = None,
                   swiglu: bool = False) -> torch.Tensor:
        """``x @ W.T`` of ``x`` [M, K] bf16 (row stride free) on AMX-INT8 (``has_amx``): x
        quantized per token with its outliers (``quantize_rows``), multiplied in int8 and scaled
        as ``scale_products`` scales (``residual``, ``swiglu`` the same), in one pass over W."""
        assert self.has_amx and w.swiglu == swiglu and x.shape[1] == w.cols
        M, N = x.shape[0], w.rows
        q, a_scale, outliers = self.quantize_rows(x, OUTLIER_TAU, for_amx=True)
        out = torch.empty(M, N // 2 if swiglu else N, dtype=torch.bfloat16)
        res_ptr, res_stride = None, 0
        if residual is not None:
            assert not swiglu and residual.dtype == torch.bfloat16 and residual.shape == (M, N)
            assert residual.stride(1) == 1
            res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
        mode = 2 if swiglu else 1 if residual is not None else 0
        o_ptrs = (None,) * 3 if outliers is None else (outliers.idx.data_ptr(), outliers.val.data_ptr(),
                                                       outliers.count.data_ptr())
        rc = self._amx(q.data_ptr(), q.stride(0), a_scale.data_ptr(), w.data.data_ptr(), w.scale.data_ptr(),
                       out.data_ptr(), out.stride(0), res_ptr, res_stride, M, N, w.cols, mode, *o_ptrs, OUTLIER_SLOTS)
        if rc != 0:
            raise RuntimeError(f"native AMX int8 product failed with code {rc}")
        return out
