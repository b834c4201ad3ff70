"""The segmented LoRA product on the CPU: ``lora_add_bf16`` of ``cpu_lora.c`` (compiled into the
native library by ``cpu_native.py``), bound with checked operands.

A linear layer's adapters are handed over as ``LoraWeights``: A of every part (q | k | v, gate |
up) stacked per slot, and B transposed per slot with the slot's scaling folded in, bf16. The
torch forms in ``engine/model_executor/layers/lora_product.py`` compute the same delta (CUDA,
float32, and the reference the tests hold the kernel to).
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels.cpu_native import NativeKernels

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
MAX_PARTS = 4  # cpu_lora.h's LORA_MAX_PARTS
MAX_H = 1024  # cpu_lora.h's LORA_MAX_H: parts * rank


class LoraWeightsDesc(ctypes.Structure):
    """``lora_weights`` of cpu_lora.h, field for field."""
    _fields_ = [("a", _P), ("bt", _P)] + [(n, _I64) for n in ("slots", "parts", "rank", "in_", "out")] + [
        ("part_end", _I64 * MAX_PARTS)]


class LoraWeights:
    """One linear layer's adapters as the kernel reads them (the tensors and their descriptor).
    a: [slots, parts * rank, in] bf16; bt: [slots, rank, out] bf16 (B transposed, scaled);
    part_end: each part's first output column past its own."""

    def __init__(self, a: torch.Tensor, bt: torch.Tensor, part_end: list[int]):
        slots, pr, in_f = a.shape
        rank, out = bt.shape[1], bt.shape[2]
        parts = len(part_end)
        assert a.dtype == bt.dtype == torch.bfloat16 and a.is_contiguous() and bt.is_contiguous()
        assert bt.shape[0] == slots and pr == parts * rank and 1 <= parts <= MAX_PARTS and pr <= MAX_H
        assert part_end[-1] == out and list(part_end) == sorted(part_end)
        self.a, self.bt, self.part_end = a, bt, list(part_end)
        self.desc = LoraWeightsDesc(a.data_ptr(), bt.data_ptr(), slots, parts, rank, in_f, out,
                                    (_I64 * MAX_PARTS)(*part_end))

    @property
    def address(self) -> int:
        """The descriptor's address (``cpu_decode_layer.c`` reads it per layer)."""
        return ctypes.addressof(self.desc)

    @property
    def in_features(self) -> int:
        return self.a.shape[2]

    @property
    def out_features(self) -> int:
        return self.bt.shape[2]


class LoraKernels:
    """The bound ``lora_add_bf16`` of one native library."""

    def __init__(self, native: NativeKernels):
        self._add = native.lib.lora_add_bf16
        self._add.argtypes = [_P, _P, _I64, _P, _I64, _P, _I32]
        self._add.restype = ctypes.c_int
        # "avx512": bf16 products on AVX-512 BF16; "portable": loops the compiler vectorizes
        self.isa = "avx512" if native.lib.lora_isa() == 512 else "portable"

    def add(self, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, w: LoraWeights) -> torch.Tensor:
        """y [M, out] += each row's delta, in place (rounded once to bf16); returns y. x [M, in]
        bf16; y bf16; both rows contiguous, row strides free; row_slots [M] int32 contiguous
        (-1: the base model, that row untouched)."""
        M = x.shape[0]
        assert x.dtype == y.dtype == torch.bfloat16 and x.stride(1) == 1 and y.stride(1) == 1
        assert x.shape[1] == w.in_features and y.shape == (M, w.out_features)
        assert row_slots.dtype == torch.int32 and row_slots.is_contiguous() and row_slots.shape == (M,)
        if M == 0:
            return y
        rc = self._add(w.address, x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), row_slots.data_ptr(), M)
        if rc == -1:
            raise ValueError(f"LoRA slots must be below {w.a.shape[0]}, got {int(row_slots.max())}")
        if rc != 0:
            raise RuntimeError(f"native LoRA product failed with code {rc}")
        return y
