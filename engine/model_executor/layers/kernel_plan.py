"""KernelPlan: which kernels a model's layers run, chosen once at load from the dtype, the
device, the CPU's instruction sets, the weight format and the engine's flags.

Every linear method and norm reads the same plan, so one step runs one family of kernels
throughout (measurements behind each threshold: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from pdserve.engine.model_executor.layers.lora_product import LoraRows
from pdserve.engine.quantization_names import UNQUANTIZED, W8A8, check_quantization
from pdserve.kernels.cpu_int8_act import Int8ActKernels
from pdserve.kernels.cpu_native import NativeKernels, native_kernels

# Steps of at most this many tokens run their linears through native gemv (a step at one
# token is a stream over the weights; from ~4 rows on gemv is bound by vdpbf16ps and the
# prepacked or panel products win).
GEMV_MAX_ROWS = 4
# An int8 LM head over at most this many sampled rows runs gemv in place at any step size
# rather than dequantizing the whole head for a few rows; its input stays in the model dtype
# under w8a8 too (per-token int8 there cost perplexity for no gain).
INT8_HEAD_GEMV_ROWS = 128
# w8a16 (and w8a8's decode steps) where the CPU has AMX-BF16: steps past gemv's rows and at
# most this many run over gemv's int8 on AMX (``NativeKernels.w8_amx_linear``); larger ones
# dequantize each matrix into torch's linear.
W8_AMX_MAX_ROWS = 256
# ...and its int8 LM head over more than this many sampled rows, at any step size.
W8_AMX_HEAD_MIN_ROWS = 8


def can_prepack(dtype: torch.dtype, device: torch.device, cpu_has_bf16: bool) -> bool:
    """oneDNN prepacked bf16 linears: CPU, bf16, native bf16 instructions, op present in this torch."""
    return (
        device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_bf16
        and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@dataclass(frozen=True)
class KernelPlan:
    """The load-time kernel choice. ``native``: the native CPU kernels (any bf16 model on CPU:
    fused RMSNorm and rope, gemv); ``gemv_rows``: steps of at most this many tokens through gemv
    (0: never); ``gemm``: larger bf16 steps through the native panel products; ``packed``: bf16
    on a CPU with native bf16 and no quantization (oneDNN prepacked linears where ``gemm`` is off);
    ``upcast``: bf16 on a CPU without native bf16, whose plain linears multiply in float32;
    ``w8_amx``: int8 steps past gemv's rows on AMX-BF16 over gemv's int8; ``a8``: w8a8's int8 x
    int8 large steps, ``int8_act`` their native passes (None: torch ops)."""

    dtype: torch.dtype
    device: torch.device
    quantization: str
    native: NativeKernels | None
    int8_act: Int8ActKernels | None
    gemv_rows: int
    gemm: bool
    packed: bool
    upcast: bool
    w8_amx: bool
    a8: bool
    lora: bool = False

    @classmethod
    def choose(cls, dtype: torch.dtype, device: torch.device, quantization: str = UNQUANTIZED,
               prepack: bool = False, gemv: bool = True, gemm: bool = True, lora: bool = False) -> "KernelPlan":
        """``prepack``: ``can_prepack`` holds; ``gemv``/``gemm``: the engine allows those kernels
        (``--disable-decode-gemv``, ``--disable-native-gemm``); ``lora``: ``--enable-lora``."""
        check_quantization(quantization)
        quant = quantization != UNQUANTIZED
        a8 = quantization == W8A8
        cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
        native = native_kernels() if cpu_bf16 else None
        packed = prepack and not quant  # int8 weights dequantize rather than keep prepacked copies
        use_gemv = gemv and native is not None and native.has_gemv
        return cls(
            dtype=dtype, device=device, quantization=quantization, native=native,
            int8_act=Int8ActKernels(native) if a8 and native is not None else None,
            gemv_rows=GEMV_MAX_ROWS if use_gemv else 0,
            gemm=packed and gemm and native.has_gemm,
            packed=packed,
            # torch's bf16 matmul without native bf16 runs far below float32's rate
            upcast=cpu_bf16 and not prepack,
            w8_amx=quant and use_gemv and native.has_w8_amx,
            a8=a8,
            lora=lora,
        )

    @property
    def quantized(self) -> bool:
        return self.quantization != UNQUANTIZED

    @property
    def amx_int8(self) -> bool:
        """w8a8's large products on AMX-INT8 (weights packed as ``AmxInt8Weight``)."""
        return self.int8_act is not None and self.int8_act.has_amx

    def fused_rows(self, enabled: bool, tp_size: int, qk_norm: bool) -> int:
        """Decode steps of at most this many rows run as one ``DecodeStack`` call (0: never): with
        gemv, at TP 1 (an all-reduce sits in each layer otherwise), without q/k norm (torch's float32
        mean is not the C kernel's sum order); any size where the layers hold panels too. Under LoRA
        too: the call adds the adapters' deltas (``cpu_lora.c``)."""
        if not (enabled and self.gemv_rows > 0 and tp_size == 1 and not qk_norm):
            return 0
        return sys.maxsize if self.gemm else self.gemv_rows


@dataclass(frozen=True)
class Step:
    """What a layer's kernel choice reads of the step: ``rows``, the step's tokens (not the
    sampled rows the last layer narrows to), and ``decode``, every row a sequence's next token."""

    rows: int
    decode: bool
    # the rows' LoRA slots (None: no row of the step uses an adapter)
    lora: LoraRows | None = None

    def narrow(self, rows: torch.Tensor) -> "Step":
        """The step past the last layer's attention, which keeps only ``rows`` (the sampled ones):
        the kernel choice stays the step's, the LoRA slots follow the rows."""
        if self.lora is None:
            return self
        return Step(self.rows, self.decode, self.lora.narrow(rows))
