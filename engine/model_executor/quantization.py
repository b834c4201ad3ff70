"""Int8 weights (``w8a16``, ``w8a8``): int8 weights with one float32 scale per output channel.

A decode step at batch 1 streams every weight once, so its time is the weights' bytes over
memory bandwidth; int8 halves the bytes of bf16. Activations stay in the model dtype. The
same int8 weights serve prefill and decode: small steps multiply them in place (the native
``gemv`` kernel widens int8 to bf16 in registers, from its packed layout ``GemvWeight`` where
it runs), larger ones dequantize one matrix at a time to the model dtype and run the dense
product, whose cost the FLOPs dominate (``dense``: natively for a packed weight).

``w8a8`` keeps the same int8 weights and the same small steps; only a large step (prefill)
differs. There the product is compute-bound, so dequantizing the weights saves nothing, but int8
products run at twice the bf16 rate (AVX-512 VNNI): the activations are quantized per token
(``quantize_rows``), multiplied in int8 into int32 (``torch._int_mm``, reading the int8 weights
in place, stored transposed) and scaled back (``int8_linear``). On a CPU with AMX-INT8 the copy
is packed for AMX instead (``amx_layout.AmxInt8Weight``) and ``cpu_amx_int8.c`` multiplies and
scales in one call. A token's few activation outliers (over ``OUTLIER_TAU`` x its mean |x|) are
left out of its int8 row and multiplied exactly, each against its column of W: one such value
otherwise sets the row's int8 step for all the others.

Symmetric per-channel absmax: row n is ``q[n] * scale[n]`` with ``scale = max|w[n]| / 127``,
so the largest weight of each row is exact and the error of any weight is at most half a step.
A GGUF file's Q8_0 weights are kept as they are instead (``Int8Weight.from_q8_0``): int8 with one
scale per block of 32 columns of a row (``scale`` [N, K / 32]), which is gemv's 32-column chunk,
so gemv scales each chunk's dot products (w8a16 only: w8a8's int8 products take a row's scale).
The layers' linear methods (``layers/linear_method.py``) hold these forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.amx_layout import AmxInt8Weight
from pdserve.kernels.cpu_int8_act import OUTLIER_SLOTS, OUTLIER_TAU, Int8ActKernels

from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.gemm_layout import PanelWeight
from pdserve.kernels.gemv_layout import CHUNK, GemvWeight


# columns per scale in GGUF's Q8_0: gemv's chunk, which is why gemv can apply them per chunk
Q8_0_BLOCK = CHUNK


@dataclass
class Int8Weight:
    q: torch.Tensor  # [N, K] int8: contiguous, or (w8a8, ``transposed``) q.t() is
    scale: torch.Tensor  # [N] float32, or [N, K / 32] for Q8_0's blocks (``blocked``)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        """Per-output-channel symmetric int8 of ``w`` [N, K] (any float dtype)."""
        w32 = w.float()
        scale = w32.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # an all-zero row stays zero
        q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.contiguous())

    @classmethod
    def from_q8_0(cls, q: torch.Tensor, scale: torch.Tensor) -> "Int8Weight":
        """Q8_0 as stored: q [N, K] int8, scale [N, K / 32] (each block's d)."""
        n, k = q.shape
        assert k % Q8_0_BLOCK == 0 and scale.shape == (n, k // Q8_0_BLOCK)
        return cls(q.contiguous(), scale.float().contiguous())

    @property
    def blocked(self) -> bool:
        return self.scale.dim() == 2

    def transposed(self) -> "Int8Weight":
        """The same weights stored as [K, N] (``q.t()`` contiguous): w8a8's form, which
        ``torch._int_mm`` reads in place and whose rows are the columns an outlier multiplies."""
        return Int8Weight(self.q.t().contiguous().t(), self.scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in ``dtype``: each product rounded once from float32."""
        if self.blocked:
            n, k = self.q.shape
            return (self.q.float().view(n, -1, Q8_0_BLOCK) * self.scale[:, :, None]).view(n, k).to(dtype)
        return (self.q.float() * self.scale[:, None]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


def dense(w: torch.Tensor | Int8Weight | GemvWeight | PanelWeight | AmxInt8Weight,
          dtype: torch.dtype) -> torch.Tensor:
    """[N, K] in ``dtype`` of a weight in any form a model holds it: plain, int8 with scales,
    either packed for native gemv or for AMX's int8 products, or bf16 packed in panels for the
    native products."""
    if isinstance(w, PanelWeight):
        return w.unpack().to(dtype)
    if isinstance(w, AmxInt8Weight):
        return Int8Weight(w.unpack(), w.scale).dequantize(dtype)
    if isinstance(w, GemvWeight):
        native = native_kernels()
        if w.scale is not None and dtype == torch.bfloat16 and native is not None and native.has_gemv:
            return native.gemv_dequantize(w)  # the same roundings, in one pass over the packed bytes
        w = w.unpack() if w.scale is None else Int8Weight(w.unpack(), w.scale)
    return w.dequantize(dtype) if isinstance(w, Int8Weight) else w.to(dtype)


def quantize_rows(x: torch.Tensor, tau: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token symmetric int8 of activations ``x`` [M, K]: q [M, K] int8 and scale [M]
    float32 with ``scale = max|x[m]| / 127``; with ``tau`` > 0 a row's values over ``tau`` x its
    mean |x| (the first OUTLIER_SLOTS in column order) are left out of q and of its scale and
    returned as a float32 [M, K] of them, zero elsewhere (``Int8ActKernels.quantize_rows`` in
    torch ops)."""
    x32 = x.float()
    outliers = None
    if tau > 0:
        a = x32.abs()
        big = a > tau * a.mean(dim=1, keepdim=True)
        big &= big.cumsum(dim=1) <= OUTLIER_SLOTS
        outliers = torch.where(big, x32, 0.0)
        x32 = torch.where(big, 0.0, x32)
    amax = x32.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x32 * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0, outliers


def int8_linear(x: torch.Tensor, w: Int8Weight | AmxInt8Weight, act: Int8ActKernels | None,
                residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """w8a8 ``x @ W.T`` in x's dtype, x [M, K] with per-token int8 activations and their outliers
    multiplied exactly; ``w``: ``transposed`` (the native passes read it so), or packed for AMX
    (``act.has_amx``: product and scaling in one native call); ``residual`` [M, N]: plus it
    before the rounding; ``swiglu`` (W = gate | up): ``up * silu(gate)``, [M, N / 2]. ``act``:
    the native passes (bf16 only), else the same in torch ops."""
    if isinstance(w, AmxInt8Weight):
        return act.amx_linear(x, w, residual, swiglu)
    wt = w.q.t()  # [K, N]
    if act is not None and x.dtype == torch.bfloat16:
        q, a_scale, outliers = act.quantize_rows(x, OUTLIER_TAU)
        return act.scale_products(torch.ops.aten._int_mm(q, wt), a_scale, w.scale, residual, swiglu, outliers, wt)
    q, a_scale, outliers = quantize_rows(x, OUTLIER_TAU)
    cols = outliers.any(dim=0).nonzero().flatten()  # the outliers' product over their columns alone
    y = torch.ops.aten._int_mm(q, wt).float() * a_scale[:, None] + outliers[:, cols] @ wt[cols].float()
    y = y * w.scale  # [M, N] float32
    if swiglu:
        inter = y.shape[1] // 2
        return (y[:, inter:] * F.silu(y[:, :inter]).to(x.dtype)).to(x.dtype)
    return (y if residual is None else y + residual.float()).to(x.dtype)
