"""Bindings of ``cpu_int8_act.c`` (compiled into the native library by ``cpu_native.py``): the
per-token int8 quantization of activations and the scaling of int8 products for ``w8a8``."""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels.cpu_native import NativeKernels

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class Int8ActKernels:
    def __init__(self, native: NativeKernels):
        lib = native.lib
        self._quant = lib.quant_rows_s8
        self._quant.argtypes, self._quant.restype = [_P, _I64, _P, _P, _I32, _I32], ctypes.c_int
        self._epilogue = lib.int8_epilogue_bf16
        self._epilogue.argtypes = [_P, _P, _P, _P, _I64, _P, _I64, _I32, _I32, _I32]
        self._epilogue.restype = ctypes.c_int

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-row int8 of ``x`` [M, K] bf16 (row stride free): q [M, K] int8 and
        scale [M] float32, ``x[m] ~= q[m] * scale[m]`` with ``scale = max|x[m]| / 127``."""
        M, K = x.shape
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1
        q = torch.empty(M, K, dtype=torch.int8)
        scale = torch.empty(M, dtype=torch.float32)
        self._quant(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), M, K)
        return q, scale

    def scale_products(self, acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                       residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
        """bf16 ``acc[m, n] * a_scale[m] * w_scale[n]`` of int32 sums ``acc`` [M, N] (contiguous):
        plus ``residual`` [M, N] bf16 before the one rounding, or with ``swiglu`` (columns
        gate | up) ``up * bf16(silu(gate))``, [M, N / 2]."""
        M, N = acc.shape
        assert acc.dtype == torch.int32 and acc.is_contiguous() and not (swiglu and residual is not None)
        for s, n in ((a_scale, M), (w_scale, N)):
            assert s.dtype == torch.float32 and s.is_contiguous() and s.numel() == n
        out = torch.empty(M, N // 2 if swiglu else N, dtype=torch.bfloat16)
        res_ptr, res_stride = None, 0
        if residual is not None:
            assert residual.dtype == torch.bfloat16 and residual.shape == (M, N) and residual.stride(1) == 1
            res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
        mode = 2 if swiglu else 1 if residual is not None else 0
        self._epilogue(acc.data_ptr(), a_scale.data_ptr(), w_scale.data_ptr(), out.data_ptr(), out.stride(0),
                       res_ptr, res_stride, M, N, mode)
        return out
