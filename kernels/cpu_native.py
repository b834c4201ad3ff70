"""Native CPU kernels: C compiled at first use with the system compiler, called through ctypes.

Why: paged decode attention is memory-bound (each step reads every cached K/V
once), but in plain torch it must first gather pages into a padded block and
then run tiny batched matmuls, which costs several times the bytes it reads.
This kernel walks each sequence's pages in place with an online-free two-pass
softmax in float32, one OpenMP task per (sequence, kv head).

The C source carries no torch headers, so it compiles in well under a second
with ``cc -O3 -march=native -fopenmp``; the library is cached under
``~/.cache/pdserve/kernels`` keyed by source, flags and CPU. It links the
``libgomp.so.1`` that torch has already loaded, so it shares torch's OpenMP
threads (and ``torch.set_num_threads``). Where no compiler is found or the
build fails, ``native_kernels()`` returns None and callers use the torch path.

The same library carries the bf16 causal prefill attention (``cpu_prefill_source``),
present where the CPU has AVX-512 BF16 (``has_prefill``), and the fused bf16
RMSNorm and rope (``cpu_norm_rope_source``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

from pdserve.kernels.cpu_norm_rope_source import NORM_ROPE_SOURCE
from pdserve.kernels.cpu_prefill_source import PREFILL_SOURCE

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#define MAX_GROUP 32
#define MAX_DIM 256

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c; c.u = (uint32_t)x << 16; return c.f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    union { uint32_t u; float f; } c; c.f = f;
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* exp for x <= 0 in plain float ops, so loops over it vectorize (libm's expf does not):
   x = n ln2 + r, |r| <= ln2 / 2; degree-6 Taylor for exp(r), relative error ~1e-7 */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = floorf(x * 1.44269504089f + 0.5f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    const float p = 1.f + r * (1.f + r * (0.5f + r * (0.16666667f + r * (0.041666668f
                    + r * (0.008333334f + r * 0.0013888889f)))));
    union { uint32_t u; float f; } c; c.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * c.f;
}
static inline float ld_bf16(const uint16_t* p, int i) { return bf16_to_f32(p[i]); }
static inline float ld_f32(const float* p, int i) { return p[i]; }
static inline void st_bf16(uint16_t* p, int i, float v) { p[i] = f32_to_bf16(v); }
static inline void st_f32(float* p, int i, float v) { p[i] = v; }

/* q: [n, ., D] rows of H heads at q_stride elements per token; caches: [pages, ps, KVH, D];
   page_table: [n, pt_stride] int32; seq_lens: [n] int32; out: [n, H, D] contiguous. */
#define DECODE_ATTN(NAME, T, LD, ST, DIMV)                                                        \
int NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,                   \
         const int32_t* page_table, int64_t pt_stride, const int32_t* seq_lens, T* out,       \
         int n, int H, int KVH, int D, int ps, float scale) {                                 \
    const int G = H / KVH;                                                                    \
    if (G > MAX_GROUP || D > MAX_DIM || D != (DIMV)) return -1;                                              \
    int failed = 0;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                          \
    for (int64_t item = 0; item < (int64_t)n * KVH; item++) {                                 \
        const int b = (int)(item / KVH), h = (int)(item % KVH);                               \
        const int L = seq_lens[b];                                                            \
        const int32_t* pages = page_table + (int64_t)b * pt_stride;                           \
        float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], kf[MAX_DIM];                   \
        float mx[MAX_GROUP], sum[MAX_GROUP];                                                  \
        float* s = (float*)malloc(sizeof(float) * (size_t)G * (size_t)(L > 0 ? L : 1));       \
        if (!s) { failed = 1; continue; }                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            const T* qp = q + (int64_t)b * q_stride + (int64_t)(h * G + g) * DIMV;               \
            for (int d = 0; d < DIMV; d++) qf[g][d] = LD(qp, d) * scale;                         \
            mx[g] = -3.0e38f; sum[g] = 0.f;                                                  \
            for (int d = 0; d < DIMV; d++) acc[g][d] = 0.f;                                      \
        }                                                                                     \
        /* pages outer, offsets inner: no division per key */                                \
        for (int l0 = 0, pi = 0; l0 < L; l0 += ps, pi++) {                                    \
          const T* kbase = k_cache + ((int64_t)pages[pi] * ps * KVH + h) * DIMV;              \
          const int nk = L - l0 < ps ? L - l0 : ps;                                           \
          for (int o = 0; o < nk; o++) {                                                      \
            const int l = l0 + o;                                                             \
            const T* kp = kbase + (int64_t)o * KVH * DIMV;                                    \
            for (int d = 0; d < DIMV; d++) kf[d] = LD(kp, d);                                    \
            for (int g = 0; g < G; g++) {                                                     \
                float dot = 0.f;                                                              \
                _Pragma("omp simd reduction(+:dot)")                                          \
                for (int d = 0; d < DIMV; d++) dot += qf[g][d] * kf[d];                          \
                s[g * L + l] = dot;                                                           \
                if (dot > mx[g]) mx[g] = dot;                                                 \
            }                                                                                 \
          }                                                                                   \
        }                                                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            float t = 0.f, m = mx[g], *sg = s + (int64_t)g * L;                               \
            _Pragma("omp simd reduction(+:t)")                                                \
            for (int l = 0; l < L; l++) { float e = exp_nonpos(sg[l] - m); sg[l] = e; t += e; } \
            sum[g] = t;                                                                       \
        }                                                                                     \
        for (int l0 = 0, pi = 0; l0 < L; l0 += ps, pi++) {                                    \
          const T* vbase = v_cache + ((int64_t)pages[pi] * ps * KVH + h) * DIMV;              \
          const int nv = L - l0 < ps ? L - l0 : ps;                                           \
          for (int o = 0; o < nv; o++) {                                                      \
            const int l = l0 + o;                                                             \
            const T* vp = vbase + (int64_t)o * KVH * DIMV;                                    \
            for (int d = 0; d < DIMV; d++) kf[d] = LD(vp, d);                                    \
            for (int g = 0; g < G; g++) {                                                     \
                const float w = s[g * L + l];                                                 \
                _Pragma("omp simd")                                                           \
                for (int d = 0; d < DIMV; d++) acc[g][d] += w * kf[d];                           \
            }                                                                                 \
          }                                                                                   \
        }                                                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            T* op = out + ((int64_t)b * H + h * G + g) * DIMV;                                   \
            const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;                              \
            for (int d = 0; d < DIMV; d++) ST(op, d, acc[g][d] * inv);                           \
        }                                                                                     \
        free(s);                                                                              \
    }                                                                                         \
    return failed ? -2 : 0;                                                                   \
}

/* head_dim as a compile-time constant lets the compiler keep rows in registers and unroll */
DECODE_ATTN(decode_attn_bf16, uint16_t, ld_bf16, st_bf16, D)
DECODE_ATTN(decode_attn_f32, float, ld_f32, st_f32, D)
DECODE_ATTN(decode_attn_bf16_d64, uint16_t, ld_bf16, st_bf16, 64)
DECODE_ATTN(decode_attn_f32_d64, float, ld_f32, st_f32, 64)
DECODE_ATTN(decode_attn_bf16_d128, uint16_t, ld_bf16, st_bf16, 128)
DECODE_ATTN(decode_attn_f32_d128, float, ld_f32, st_f32, 128)
""" + PREFILL_SOURCE + NORM_ROPE_SOURCE

# Reassociation lets the dot products and sums vectorize (~1.7x here). Not -ffast-math: with
# gcc < 13 it links crtfastmath into a shared library, which turns on flush-to-zero process-wide.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
_lock = threading.Lock()
_cached: "NativeKernels | None | bool" = False  # False: not tried yet


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _build() -> str:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, compiler, _cpu_signature()]).encode()).hexdigest()[:16]
    cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "kernels")
    lib_path = os.path.join(cache_dir, f"pdserve_cpu_{key}.so")
    if os.path.isfile(lib_path):
        return lib_path
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src = os.path.join(tmp, "kernels.c")
        with open(src, "w") as f:
            f.write(_SOURCE)
        out = os.path.join(tmp, "kernels.so")
        proc = subprocess.run([compiler, *_FLAGS, src, "-o", out, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[:2000]}")
        os.replace(out, lib_path)  # atomic: concurrent builders race harmlessly
    return lib_path


_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class NativeKernels:
    def __init__(self, lib_path: str):
        self.lib = ctypes.CDLL(lib_path)
        decode_args = [_P, _I64, _P, _P, _P, _I64, _P, _P] + [_I32] * 5 + [_F]
        self._decode = {}  # (dtype, head_dim or None for any) -> function
        for dtype, tname in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            for dim, suffix in ((None, ""), (64, "_d64"), (128, "_d128")):
                self._decode[(dtype, dim)] = self._bind(f"decode_attn_{tname}{suffix}", decode_args)
        self._prefill = self._bind("prefill_attn_bf16", [_P, _I64] * 3 + [_P, _P, _I64, _P, _P] + [_I32] * 5 + [_F])
        self.has_prefill = bool(self.lib.prefill_attn_supported())
        self._rms_norm = self._bind("rms_norm_bf16", [_P, _I64, _P, _P, _I64, _I32, _I32, _F])
        self._rope = self._bind("rope_bf16", [_P, _I64] + [_P] * 4 + [_I32] * 3)

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
        Token strides are free; heads and dims must be contiguous.
        """
        n, num_heads, dim = q.shape
        kv_heads = k.shape[1]
        keys = k.shape[0] if key_rows is None else key_rows.numel()
        if key_rows is not None:
            assert key_rows.dtype == torch.int64 and key_rows.is_contiguous()
        for name, t in (("q", q), ("k", k), ("v", v)):
            assert t.dtype == torch.bfloat16 and t.stride(2) == 1 and t.stride(1) == dim, f"{name}: bf16, heads/dims contiguous"
        assert v.shape == k.shape and keys >= n and out.shape == (n, num_heads * dim) and out.stride(1) == 1 and out.dtype == q.dtype
        padded = -(-keys // 64) * 64
        scratch = torch.empty(2, kv_heads * padded * dim, dtype=torch.bfloat16)
        rc = self._prefill(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
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

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Paged decode attention over whole sequences (every row is one sequence's last token).

        q: [n, H, D] (token stride free, heads and dims contiguous); k_cache, v_cache:
        [pages, page_size, KVH, D]; page_table: [n, P] int32 contiguous; seq_lens: [n] int32.
        Returns [n, H * D].
        """
        n, num_heads, dim = q.shape
        _, page_size, kv_heads, _ = k_cache.shape
        assert q.stride(2) == 1 and q.stride(1) == dim, "heads and dims of q must be contiguous"
        assert page_table.dtype == torch.int32 and page_table.is_contiguous() and seq_lens.dtype == torch.int32
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype
        out = torch.empty(n, num_heads * dim, dtype=q.dtype)
        fn = self._decode.get((q.dtype, dim)) or self._decode[(q.dtype, None)]
        rc = fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), page_table.data_ptr(),
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
                _cached = NativeKernels(_build())
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("native CPU kernels unavailable, using torch ops: %s", exc)
                _cached = None
        return _cached
