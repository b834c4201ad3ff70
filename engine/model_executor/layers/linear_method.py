"""Linear methods: how a linear layer holds its weight and multiplies by it, one class per
weight format (vLLM's ``LinearMethodBase``), chosen at load (``linear_method``).

A method ``prepare``s the layer's whole (TP-sliced, fused) matrix once into the forms its
kernels read, then ``apply`` picks the kernel by the step's size: gemv at small steps, the
native panel products, oneDNN's prepacked linears, int8 products or torch's linear at larger
ones. Every product may fuse a residual add (the row-parallel output) or, for a ``swiglu``
weight (rows gate | up), SiLU(gate) * up, so a dense layer is four calls.

An expert layer (``moe.FusedMoE``) holds one method per expert weight in the same way: each
prepared form is per matrix, and ``apply`` takes any rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from pdserve.engine.model_executor.layers.kernel_plan import (INT8_HEAD_GEMV_ROWS, W8_AMX_HEAD_MIN_ROWS,
                                                              W8_AMX_MAX_ROWS, KernelPlan, Step)
from pdserve.engine.model_executor.quantization import Int8Weight, dense, int8_linear
from pdserve.kernels.amx_layout import AmxInt8Weight
from pdserve.kernels.gemm_layout import PanelWeight
from pdserve.kernels.gemv_layout import GemvWeight

Weight = torch.Tensor | Int8Weight | GemvWeight | PanelWeight | AmxInt8Weight


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 64)


class LinearMethod(ABC):
    """One weight matrix W [N, K] in the forms its kernels read. ``swiglu``: W is gate | up and
    ``apply`` returns SiLU(x @ gate.T) * (x @ up.T), [M, N / 2]."""

    #: the form gemv reads (steps of at most ``plan.gemv_rows``; the fused decode step), or None
    gemv: GemvWeight | None = None
    #: the form larger steps read (plain, oneDNN-prepacked, panels, int8...), or None
    large: Weight | None = None

    def __init__(self, plan: KernelPlan, swiglu: bool = False):
        self.plan = plan
        self.swiglu = swiglu

    @abstractmethod
    def prepare(self, w: torch.Tensor | None, q8_0: Int8Weight | None = None) -> None:
        """Build the forms from ``w`` [N, K] in the model dtype (or from a GGUF file's Q8_0 int8,
        ``q8_0``, where the method keeps int8 weights); ``w`` may be dropped afterwards."""

    @abstractmethod
    def apply(self, x: torch.Tensor, step: Step, residual: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype (SwiGLU: [M, N / 2]); plus ``residual`` [M, N] (fused
        where the kernel can); plus ``bias`` [N] (never both)."""

    @abstractmethod
    def apply_logits(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """The LM head's product: x [M, K] (M sampled rows) -> [M, N], float32 or the model dtype."""

    def dense(self) -> torch.Tensor:
        """W [N, K] in float32, read back from the forms (``get_weights_by_name``)."""
        return dense(self.large, torch.float32)

    # the plain linear of steps no native kernel takes
    def _linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = self.plan.dtype
        if self.plan.upcast:  # bf16 without native bf16: multiply in float32, round once
            b = None if bias is None else bias.float()
            return F.linear(x.float(), dense(w, torch.float32), b).to(dtype)
        return F.linear(x, dense(w, dtype), bias)

    def _plain(self, x: torch.Tensor, w: Weight, residual: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.Tensor:
        y = self._linear(x, w, bias)
        if self.swiglu:
            inter = y.shape[1] // 2
            return F.silu(y[:, :inter]) * y[:, inter:]
        return y if residual is None else residual + y

    def _gemv(self, x: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.plan.native.gemv(x, self.gemv, residual=residual)
        return y if bias is None else y + bias


class UnquantizedLinearMethod(LinearMethod):
    """bf16 or float32 weights: gemv's packed copy beside the larger steps' panels, oneDNN's
    prepacked weight (SwiGLU: gate and up apart, for its post-ops) or the plain tensor."""

    gate: torch.Tensor | None = None  # oneDNN-prepacked halves of a SwiGLU weight
    up: torch.Tensor | None = None

    def prepare(self, w: torch.Tensor | None, q8_0: Int8Weight | None = None) -> None:
        plan = self.plan
        self.gemv = GemvWeight.pack(w, self.swiglu) if plan.gemv_rows else None
        if plan.gemm:
            self.large = PanelWeight.pack(w, swiglu=self.swiglu)
        elif plan.packed and self.swiglu:
            inter = w.shape[0] // 2
            self.large, self.gate, self.up = None, _onednn_pack(w[:inter]), _onednn_pack(w[inter:])
        elif plan.packed:
            self.large = _onednn_pack(w)
        else:
            self.large = w

    def apply(self, x, step, residual=None, bias=None):
        plan = self.plan
        if step.rows <= plan.gemv_rows:
            return self._gemv(x, residual, bias)
        if plan.gemm:
            return plan.native.gemm(x, self.large, residual=residual, bias=bias)  # one rounding
        if plan.packed:
            lp = torch.ops.mkldnn._linear_pointwise
            if self.swiglu:
                return lp.binary(x, lp(x, self.gate, None, "swish", [], ""), self.up, None, "mul")
            if residual is not None:
                return lp.binary(x, residual, self.large, bias, "add")
            return lp(x, self.large, bias, "none", [], "")
        return self._plain(x, self.large, residual, bias)

    def apply_logits(self, x, step):
        plan = self.plan
        if step.rows <= plan.gemv_rows:
            return plan.native.gemv(x, self.gemv)
        if plan.gemm:
            return plan.native.gemm(x, self.large, out_dtype=torch.float32)  # no widening pass after
        if plan.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.large, None, "none", [], "")
        return self._linear(x, self.large, None)

    def dense(self) -> torch.Tensor:
        if self.plan.packed and not self.plan.gemm:  # oneDNN's layout cannot be read back
            if self.gemv is None:
                raise ValueError("this weight is held only in oneDNN's prepacked layout (bf16 without native "
                                 "gemv); start with --dtype float32 or without --disable-decode-gemv to read it")
            return dense(self.gemv, torch.float32)
        return dense(self.large, torch.float32)


class Int8LinearMethod(LinearMethod):
    """w8a16: per-channel int8 (or a GGUF file's Q8_0 blocks as stored), one copy: packed for
    gemv where it runs (multiplied in place, or on AMX-BF16 past gemv's rows), dequantized per
    matrix into torch's linear at larger steps."""

    def _int8(self, w: torch.Tensor | None, q8_0: Int8Weight | None) -> Int8Weight:
        return q8_0 if q8_0 is not None else Int8Weight.quantize(w)

    def prepare(self, w: torch.Tensor | None, q8_0: Int8Weight | None = None) -> None:
        q = self._int8(w, q8_0)
        if self.plan.gemv_rows:
            self.gemv = self.large = GemvWeight.pack(q.q, self.swiglu, q.scale)
        else:
            self.large = q

    def _amx(self, step: Step) -> bool:
        return self.plan.w8_amx and step.rows <= W8_AMX_MAX_ROWS

    def apply(self, x, step, residual=None, bias=None):
        if step.rows <= self.plan.gemv_rows:
            return self._gemv(x, residual, bias)
        if self._amx(step):
            return self.plan.native.w8_amx_linear(x, self.gemv, residual=residual, bias=bias)
        return self._plain(x, self.large, residual, bias)

    def apply_logits(self, x, step):
        plan = self.plan
        rows = x.shape[0]
        if step.rows <= plan.gemv_rows or (
                plan.gemv_rows and rows <= (W8_AMX_HEAD_MIN_ROWS if plan.w8_amx else INT8_HEAD_GEMV_ROWS)):
            return plan.native.gemv(x, self.gemv)
        if plan.w8_amx:
            return plan.native.w8_amx_linear(x, self.gemv, out_dtype=torch.float32)
        return self._linear(x, self.large, None)


class W8A8LinearMethod(Int8LinearMethod):
    """w8a8: w8a16's int8 weights and small steps; a large step's products int8 x int8 over
    per-token int8 activations (``quantization.int8_linear``), reading a copy of the int8
    transposed, or packed for AMX-INT8. Decode steps past gemv's rows run as w8a16's on
    AMX-BF16 where it is; the LM head is w8a16's (its input stays in the model dtype)."""

    def prepare(self, w: torch.Tensor | None, q8_0: Int8Weight | None = None) -> None:
        q = self._int8(w, q8_0)
        self.large = AmxInt8Weight.pack(q.q, q.scale, self.swiglu) if self.plan.amx_int8 else q.transposed()
        if self.plan.gemv_rows:
            self.gemv = GemvWeight.pack(q.q, self.swiglu, q.scale)

    def _amx(self, step: Step) -> bool:
        return super()._amx(step) and step.decode

    def apply(self, x, step, residual=None, bias=None):
        if step.rows <= self.plan.gemv_rows or self._amx(step):
            return super().apply(x, step, residual, bias)
        y = int8_linear(x, self.large, self.plan.int8_act, residual=residual, swiglu=self.swiglu)
        return y if bias is None else y + bias


def linear_method(plan: KernelPlan, swiglu: bool = False, head: bool = False) -> LinearMethod:
    """The method for ``plan``'s weight format; ``head``: for an LM head (whose input is never int8)."""
    if not plan.quantized:
        return UnquantizedLinearMethod(plan, swiglu)
    if plan.a8 and not head:
        return W8A8LinearMethod(plan, swiglu)
    return Int8LinearMethod(plan, swiglu)
