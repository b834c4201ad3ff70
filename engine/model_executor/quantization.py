"""Weight-only int8 (``w8a16``): int8 weights with one float32 scale per output channel.

A decode step at batch 1 streams every weight once, so its time is the weights' bytes over
memory bandwidth; int8 halves the bytes of bf16. Activations stay in the model dtype. The
same int8 weights serve prefill and decode: small steps multiply them in place (the native
``gemv`` kernel widens int8 to bf16 in registers, from its packed layout ``GemvWeight`` where
it runs), larger ones dequantize one matrix at a time to the model dtype and run the dense
product, whose cost the FLOPs dominate (``dense``: natively for a packed weight).

Symmetric per-channel absmax: row n is ``q[n] * scale[n]`` with ``scale = max|w[n]| / 127``,
so the largest weight of each row is exact and the error of any weight is at most half a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.gemv_layout import GemvWeight


@dataclass
class Int8Weight:
    q: torch.Tensor  # [N, K] int8, contiguous
    scale: torch.Tensor  # [N] float32

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        """Per-output-channel symmetric int8 of ``w`` [N, K] (any float dtype)."""
        w32 = w.float()
        scale = w32.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # an all-zero row stays zero
        q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.contiguous())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in ``dtype``: each product rounded once from float32."""
        return (self.q.float() * self.scale[:, None]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


def dense(w: torch.Tensor | Int8Weight | GemvWeight, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] in ``dtype`` of a weight in any form a model holds it: plain, int8 with scales, or
    either packed for native gemv."""
    if isinstance(w, GemvWeight):
        native = native_kernels()
        if w.scale is not None and dtype == torch.bfloat16 and native is not None and native.has_gemv:
            return native.gemv_dequantize(w)  # the same roundings, in one pass over the packed bytes
        w = w.unpack() if w.scale is None else Int8Weight(w.unpack(), w.scale)
    return w.dequantize(dtype) if isinstance(w, Int8Weight) else w.to(dtype)
