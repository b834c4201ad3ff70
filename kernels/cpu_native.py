"""Native CPU kernels: C compiled at first use with the system compiler, called through ctypes.

The C sources are package data next to this file (each says why it exists):
``cpu_decode_attn.c``, paged decode attention read in place from the pages;
``cpu_prefill_attn.c``, bf16 causal prefill attention, present where the CPU has
AVX-512 BF16 (``has_prefill``); ``cpu_norm_rope.c``, the fused bf16 RMSNorm and
rope; ``cpu_gemv.c``, the decode step's skinny products over bf16 or int8 weights
packed as ``gemv_layout.GemvWeight`` (``has_gemv``: AVX-512 BF16, VBMI and VNNI, or AVX2 and FMA,
``gemv_isa`` says which; their block kernels in ``cpu_gemv_avx512.h`` and ``cpu_gemv_avx2.h``),
and over the same int8 the larger products of w8a16 on AMX-BF16 (``has_w8_amx``);
``cpu_decode_layer.c``, a small decode step's layers in one call of those kernels
(``decode_step.DecodeStack``, any decode step where the model holds panels); ``cpu_gemm.c``, the bf16
products of every larger step over weights packed as ``gemm_layout.PanelWeight``
(``has_gemm``, AVX-512 BF16 without AMX); ``cpu_kv_store.c``, a layer's KV store into the
head-major pool; ``cpu_int8_act.c``, w8a8's per-token int8 activations and the scaling of its
int8 products, and ``cpu_amx_int8.c``, those products and their scaling in one call on AMX-INT8
over weights packed as ``amx_layout.AmxInt8Weight`` (both bound in ``cpu_int8_act.py``);
``cpu_argmax.c``, the greedy pick over float32 logits; ``cpu_moe.c``, a mixture-of-experts
layer's routed experts in one call (bound in ``cpu_moe.py``); ``cpu_mla_decode.c``, multi-head latent
attention's absorbed decode over latent pages (bound in ``mla_decode.py``); ``cpu_lora.c``, the
segmented LoRA product of rows on different adapters (bound in ``cpu_lora.py``; also called
inside the fused decode step);
``cpu_common.h``, their bf16 conversions, exp and silu; ``cpu_amx.h``, the AMX tiles' permission and
configuration;
and ``cpu_bf16_avx512.h`` the same conversions and silu on AVX-512 vectors.

``native_build.py`` compiles them (or finds the cached library) and this module binds its
functions through ctypes with checked operands. Where no compiler is found or the build fails,
``native_kernels()`` returns None and callers use the torch path.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading

import torch

from pdserve.kernels.gemm_layout import PanelWeight
from pdserve.kernels.gemv_layout import GemvWeight
from pdserve.kernels.native_build import build_library, cpu_flags

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_cached: "NativeKernels | None | bool" = False  # False: not tried yet
__all__ = ["NativeKernels", "cpu_flags", "kernels_for", "native_kernels"]


_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _product_args(x: torch.Tensor, weight: GemvWeight | PanelWeight, residual: torch.Tensor | None,
                  out_dtype: torch.dtype) -> tuple:
    """A native product's checked operands: (M, N, K, a new output, epilogue mode, residual
    pointer, residual row stride). x [M, K] bf16 with contiguous rows; out [M, N], or [M, N / 2]
    for a SwiGLU weight (mode 2); mode 1 with a residual [M, N] bf16, else 0."""
    M, K = x.shape
    N = weight.rows
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and weight.cols == K
    assert not (weight.swiglu and residual is not None) and out_dtype in (torch.bfloat16, torch.float32)
    out = torch.empty(M, N // 2 if weight.swiglu else N, dtype=out_dtype)
    mode = 2 if weight.swiglu else 1 if residual is not None else 0
    if residual is not None:
        assert residual.dtype == torch.bfloat16 and residual.shape == (M, N) and residual.stride(1) == 1
    res_ptr, res_stride = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
    return M, N, K, out, mode, res_ptr, res_stride


class NativeKernels:
    def __init__(self, lib_path: str):
        self.lib = ctypes.CDLL(lib_path)
        decode_args = [_P, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P] + [_I32] * 5 + [_F]
        self._decode = {}  # (dtype, head_dim or None for any) -> function
        for dtype, tname in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            for dim, suffix in ((None, ""), (64, "_d64"), (128, "_d128")):
                self._decode[(dtype, dim)] = self._bind(f"decode_attn_{tname}{suffix}", decode_args)
        self._prefill = self._bind("prefill_attn_bf16", [_P, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _P, _P]
                                   + [_I32] * 5 + [_F])
        self.has_prefill = bool(self.lib.prefill_attn_supported())
        self._rms_norm = self._bind("rms_norm_bf16", [_P, _I64, _P, _P, _I64, _I32, _I32, _F])
        self._rope = self._bind("rope_bf16", [_P, _I64] + [_P] * 4 + [_I32] * 3)
        self.gemv_isa = {512: "avx512", 2: "avx2"}.get(self.lib.gemv_isa())  # None: no gemv
        self.has_gemv = self.gemv_isa is not None
        self._gemv = self._bind("gemv_bf16", [_P, _I64, _P, _P, _I64, _P, _I64] + [_I32] * 4)
        self._gemv_w8 = self._bind("gemv_w8_bf16", [_P, _I64, _P, _P, _I32, _P, _I64, _P, _I64] + [_I32] * 4)
        self._gemv_w8_dequantize = self._bind("gemv_w8_dequantize", [_P, _P, _I32, _I32, _I32, _I32, _P])
        # int8 gemv weights' larger products on AMX-BF16 (w8a16's steps past gemv's rows)
        self.has_w8_amx = bool(self.lib.gemv_w8_amx())
        self._w8_amx = self._bind("gemv_w8_amx_linear", [_P, _I64, _P, _P, _I32, _P, _I64, _P, _I64] + [_I32] * 5)
        self._kv_store = self._bind("kv_store", [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _P, _I32, _I32,
                                                 _I64])
        self.has_gemm = bool(self.lib.gemm_supported())
        self._gemm = self._bind("gemm_bf16", [_P, _I64, _P, _P, _I64, _P, _I64, _P] + [_I32] * 5)
        self._argmax = self._bind("argmax_rows_f32", [_P, _I64, _I32, _I32, _P])
        # it runs the gemv kernels, so it is there where they are
        self.decode_layers = self._bind("decode_layers_bf16", [_P, _P, _I32, _P, _P, _P, _I64, _P, _I32, _I32, _P,
                                                                _I32, _P, _P])

    def _bind(self, name: str, argtypes: list) -> ctypes._CFuncPtr:
        fn = getattr(self.lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn

    def supports(self, dtype: torch.dtype, group: int, head_dim: int) -> bool:
        return (dtype, None) in self._decode and group <= 32 and head_dim <= 256

    def supports_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        return self.has_prefill and dtype == torch.bfloat16 and head_dim in (64, 128)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          scale: float, key_rows: torch.Tensor | None = None) -> None:
        """Causal attention of ``n`` new tokens over ``Lk >= n`` keys (the first ``Lk - n`` a cached
        prefix), written into ``out``. bf16 only (``supports_prefill``).

        q: [n, H, D]; k, v: [Lk, KVH, D], or with ``key_rows`` ([Lk] int64: key j is row
        ``key_rows[j]``) any rows, e.g. the page pool's slots read in place; out: [n, H * D].
        Token and (for k, v) head strides are free; dims must be contiguous, and q's heads.
        """
        n, num_heads, dim = q.shape
        kv_heads = k.shape[1]
        keys = k.shape[0] if key_rows is None else key_rows.numel()
        if key_rows is not None:
            assert key_rows.dtype == torch.int64 and key_rows.is_contiguous()
        for name, t in (("q", q), ("k", k), ("v", v)):
            assert t.dtype == torch.bfloat16 and t.stride(2) == 1, f"{name}: bf16, dims contiguous"
        assert q.stride(1) == dim, "q: heads contiguous"
        assert v.shape == k.shape and keys >= n and out.shape == (n, num_heads * dim) and out.stride(1) == 1 and out.dtype == q.dtype
        padded = -(-keys // 64) * 64
        scratch = torch.empty(2, kv_heads * padded * dim, dtype=torch.bfloat16)
        rc = self._prefill(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            None if key_rows is None else key_rows.data_ptr(), out.data_ptr(), out.stride(0),
            scratch[0].data_ptr(), scratch[1].data_ptr(), n, keys, num_heads, kv_heads, dim, scale,
        )
        if rc != 0:
            raise RuntimeError(f"native prefill attention failed with code {rc}")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """bf16 RMSNorm of each row of ``x`` [T, N] (row stride free) with ``weight`` [N]: a new [T, N]."""
        T, N = x.shape
        assert x.dtype == weight.dtype == torch.bfloat16 and x.stride(1) == 1 and weight.is_contiguous()
        out = torch.empty(T, N, dtype=x.dtype)
        self._rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), N, T, N, eps)
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half rope of ``x`` [T, heads, D] (token stride free) at ``positions`` [T] int64, with
        ``cos``/``sin`` tables [ctx, D]: a new contiguous [T, heads, D]."""
        T, heads, dim = x.shape
        assert x.dtype == cos.dtype == sin.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(1) == dim
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] == dim
        assert positions.dtype == torch.int64 and positions.is_contiguous()
        out = torch.empty(T, heads, dim, dtype=x.dtype)
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), out.data_ptr(),
                   T, heads, dim)
        return out

    def gemv(self, x: torch.Tensor, weight: GemvWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T`` for a few rows ``x`` [M, K] bf16 (row stride free): a new [M, N] bf16.

        weight: W [N, K] packed (bf16, or int8 with its scales). ``residual`` [M, N]: returns
        ``residual + x @ W.T`` (one rounding). A SwiGLU weight (gate | up, [2 I, K]): returns
        ``silu(x @ gate.T) * (x @ up.T)``, [M, I]. Requires ``has_gemv``.
        """
        M, K = x.shape
        N = weight.rows
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and weight.cols == K
        assert not (weight.swiglu and residual is not None)
        out = torch.empty(M, N // 2 if weight.swiglu else N, dtype=torch.bfloat16)
        mode = 2 if weight.swiglu else 1 if residual is not None else 0
        if residual is not None:
            assert residual.dtype == torch.bfloat16 and residual.shape == (M, N) and residual.stride(1) == 1
        res_ptr, res_stride = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
        if weight.scale is not None:
            rc = self._gemv_w8(x.data_ptr(), x.stride(0), weight.data.data_ptr(), weight.scale.data_ptr(),
                               int(weight.blocked), out.data_ptr(), out.stride(0), res_ptr, res_stride, M, N, K, mode)
        else:
            rc = self._gemv(x.data_ptr(), x.stride(0), weight.data.data_ptr(), out.data_ptr(), out.stride(0), res_ptr,
                            res_stride, M, N, K, mode)
        if rc != 0:
            raise RuntimeError(f"native gemv failed with code {rc}")
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` of float32 ``x`` [M, V] (row stride free), as torch answers it (the first
        index of the maximum; a NaN is the maximum): a new [M] int64."""
        M, V = x.shape
        assert x.dtype == torch.float32 and x.stride(1) == 1 and V > 0
        out = torch.empty(M, dtype=torch.int64)
        if M:
            self._argmax(x.data_ptr(), x.stride(0), M, V, out.data_ptr())
        return out

    def store_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """``kv_ops.store_kv`` natively: k, v [T, kv_heads, head_dim] (any token and head strides,
        rows contiguous; or [T, kv_heads * head_dim]) into slots ``loc`` [T] int64 of the
        head-major caches."""
        heads, _, _, dim = k_cache.shape
        k, v = k.view(k.shape[0], heads, dim), v.view(v.shape[0], heads, dim)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
        assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and loc.dtype == torch.int64 and loc.is_contiguous()
        assert k.shape == v.shape == (loc.numel(), heads, dim) and k.stride(2) == v.stride(2) == 1
        e = k.element_size()
        self._kv_store(k.data_ptr(), k.stride(0) * e, k.stride(1) * e, v.data_ptr(), v.stride(0) * e, v.stride(1) * e,
                       k_cache.data_ptr(), v_cache.data_ptr(), dim * e, k_cache.stride(0) * e, loc.data_ptr(),
                       loc.numel(), heads, dim * e)

    def gemm(self, x: torch.Tensor, weight: PanelWeight, residual: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``x @ W.T`` for any number of rows ``x`` [M, K] bf16 (row stride free): a new [M, N]
        tensor, bf16, or float32 holding the bf16-rounded values (``out_dtype``).

        weight: W [N, K] bf16 packed in panels. ``residual`` [M, N] bf16: returns ``residual + x @
        W.T`` (one rounding); ``bias`` [N] bf16: adds it before that rounding. A SwiGLU weight
        (gate | up, [2 I, K]): returns ``silu(x @ gate.T) * (x @ up.T)``, [M, I]. Requires
        ``has_gemm``.
        """
        M, N, K, out, mode, res_ptr, res_stride = _product_args(x, weight, residual, out_dtype)
        if bias is not None:
            assert not weight.swiglu and bias.dtype == torch.bfloat16 and bias.shape == (N,) and bias.is_contiguous()
        rc = self._gemm(x.data_ptr(), x.stride(0), weight.data.data_ptr(), out.data_ptr(), out.stride(0), res_ptr,
                        res_stride, None if bias is None else bias.data_ptr(), M, N, K, mode,
                        int(out_dtype == torch.float32))
        if rc != 0:
            raise RuntimeError(f"native gemm failed with code {rc}")
        return out

    def w8_amx_linear(self, x: torch.Tensor, weight: GemvWeight, residual: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``gemv``'s product for any number of rows over an int8 ``weight``, on AMX-BF16: x [M, K]
        bf16 (row stride free) times q, each row's sums times its scale (Q8_0: times the weights
        dequantized as ``gemv_dequantize`` does), a new [M, N] (SwiGLU: [M, N / 2]), bf16 or
        float32 holding the bf16-rounded values (``out_dtype``). ``bias`` [N] is added after the
        rounding, as to gemv's output. Requires ``has_w8_amx``."""
        assert weight.scale is not None
        M, N, K, out, mode, res_ptr, res_stride = _product_args(x, weight, residual, out_dtype)
        rc = self._w8_amx(x.data_ptr(), x.stride(0), weight.data.data_ptr(), weight.scale.data_ptr(),
                          int(weight.blocked), out.data_ptr(), out.stride(0), res_ptr, res_stride, M, N, K, mode,
                          int(out_dtype == torch.float32))
        if rc != 0:
            raise RuntimeError(f"native w8 AMX linear failed with code {rc}")
        return out if bias is None else out + bias

    def gemv_dequantize(self, weight: GemvWeight) -> torch.Tensor:
        """[N, K] bf16 of a packed int8 weight: ``bf16(q[n] * scale[n])`` (or per chunk, Q8_0), as
        ``quantization.Int8Weight.dequantize`` rounds it, without unpacking through torch (25x
        slower than the dequantization itself at one thread). Requires ``has_gemv``."""
        assert weight.scale is not None
        out = torch.empty(weight.rows, weight.cols, dtype=torch.bfloat16)
        rc = self._gemv_w8_dequantize(weight.data.data_ptr(), weight.scale.data_ptr(), int(weight.blocked),
                                      weight.rows, weight.cols, int(weight.swiglu), out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native gemv dequantize failed with code {rc}")
        return out

    def decode_attention_fn(self, dtype: torch.dtype, dim: int) -> ctypes._CFuncPtr:
        return self._decode.get((dtype, dim)) or self._decode[(dtype, None)]

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Paged decode attention over whole sequences (every row is one sequence's last token).

        q: [n, H, D] (token stride free, heads and dims contiguous); k_cache, v_cache: the pool's
        head-major [KVH, pages, page_size, D]; page_table: [n, P] int32 contiguous; seq_lens: [n] int32.
        Returns [n, H * D].
        """
        n, num_heads, dim = q.shape
        kv_heads, _, page_size, _ = k_cache.shape
        assert q.stride(2) == 1 and q.stride(1) == dim, "heads and dims of q must be contiguous"
        assert page_table.dtype == torch.int32 and page_table.is_contiguous() and seq_lens.dtype == torch.int32
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype
        out = torch.empty(n, num_heads * dim, dtype=q.dtype)
        rc = self.decode_attention_fn(q.dtype, dim)(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), page_table.data_ptr(),
            page_table.stride(0), seq_lens.data_ptr(), out.data_ptr(), n, num_heads, kv_heads, dim,
            page_size, scale,
        )
        if rc != 0:
            raise RuntimeError(f"native decode attention failed with code {rc}")
        return out


def native_kernels() -> NativeKernels | None:
    """The compiled kernels, or None where they cannot be built (logged once)."""
    global _cached
    with _lock:
        if _cached is False:
            try:
                _cached = NativeKernels(build_library())
                logger.info("native CPU kernels built; gemv on %s", _cached.gemv_isa or "none (oneDNN products)")
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("native CPU kernels unavailable, using torch ops: %s", exc)
                _cached = None
        return _cached


def kernels_for(march: str) -> NativeKernels:
    """The kernels compiled for another ``-march`` than this CPU's (e.g. ``x86-64-v3``, AVX2 and
    FMA), so that the tests run each instruction set's paths where the CPU has several. Raises
    where the build fails."""
    return NativeKernels(build_library(march))
