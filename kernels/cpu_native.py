"""Native CPU kernels: C compiled at first use with the system compiler, called through ctypes.

The C sources are package data next to this file (each says why it exists):
``cpu_decode_attn.c``, paged decode attention read in place from the pages;
``cpu_prefill_attn.c``, bf16 causal prefill attention, present where the CPU has
AVX-512 BF16 (``has_prefill``); ``cpu_norm_rope.c``, the fused bf16 RMSNorm and
rope; ``cpu_gemv.c``, the decode step's skinny products over bf16 or int8 weights
(``has_gemv``, AVX-512 BF16); ``cpu_common.h``, their bf16 conversions and exp.

They carry no torch headers, so they compile in well under a second with
``cc -O3 -march=native -fopenmp`` into one library, cached under
``~/.cache/pdserve/kernels`` keyed by sources, flags and CPU. It links the
``libgomp.so.1`` that torch has already loaded, so it shares torch's OpenMP
threads (and ``torch.set_num_threads``). Where no compiler is found or the
build fails, ``native_kernels()`` returns None and callers use the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

logger = logging.getLogger(__name__)

# the C sources, package data next to this file; the .c files are the translation units
_SOURCES = ("cpu_common.h", "cpu_decode_attn.c", "cpu_prefill_attn.c", "cpu_norm_rope.c", "cpu_gemv.c")

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


def _read_sources() -> dict[str, str]:
    package = importlib.resources.files(__package__)
    return {name: (package / name).read_text() for name in _SOURCES}


def _build() -> str:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    sources = _read_sources()
    key_parts = [text for name in _SOURCES for text in (name, sources[name])]
    key = hashlib.sha256("\0".join([*key_parts, *_FLAGS, compiler, _cpu_signature()]).encode()).hexdigest()[:16]
    cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "kernels")
    lib_path = os.path.join(cache_dir, f"pdserve_cpu_{key}.so")
    if os.path.isfile(lib_path):
        return lib_path
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        for name, text in sources.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        units = [os.path.join(tmp, name) for name in _SOURCES if name.endswith(".c")]
        out = os.path.join(tmp, "kernels.so")
        proc = subprocess.run([compiler, *_FLAGS, *units, "-o", out, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[:2000]}")
        os.replace(out, lib_path)  # atomic: concurrent builders race harmlessly
    return lib_path


_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


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
        self.has_gemv = bool(self.lib.gemv_supported())
        self._gemv = self._bind("gemv_bf16", [_P, _I64, _P, _P, _I64, _P, _I64] + [_I32] * 4)
        self._gemv_w8 = self._bind("gemv_w8_bf16", [_P, _I64, _P, _P, _P, _I64, _P, _I64] + [_I32] * 4)

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

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
        """``x @ W.T`` for a few rows ``x`` [M, K] bf16 (row stride free): a new [M, N] bf16.

        weight: [N, K] contiguous, bf16, or int8 with ``scale`` [N] float32 (row n is
        ``weight[n] * scale[n]``). ``residual`` [M, N]: returns ``residual + x @ W.T`` (one rounding).
        ``swiglu``: weight is gate | up, [2 I, K]; returns ``silu(x @ gate.T) * (x @ up.T)``, [M, I].
        Requires ``has_gemv``.
        """
        M, K = x.shape
        N = weight.shape[0]
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] == K
        assert not (swiglu and residual is not None)
        out = torch.empty(M, N // 2 if swiglu else N, dtype=torch.bfloat16)
        mode = 2 if swiglu else 1 if residual is not None else 0
        if residual is not None:
            assert residual.dtype == torch.bfloat16 and residual.shape == (M, N) and residual.stride(1) == 1
        res_ptr, res_stride = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
        if weight.dtype == torch.int8:
            assert scale is not None and scale.dtype == torch.float32 and scale.is_contiguous() and scale.numel() == N
            rc = self._gemv_w8(x.data_ptr(), x.stride(0), weight.data_ptr(), scale.data_ptr(), out.data_ptr(),
                               out.stride(0), res_ptr, res_stride, M, N, K, mode)
        else:
            assert weight.dtype == torch.bfloat16 and scale is None
            rc = self._gemv(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), res_ptr,
                            res_stride, M, N, K, mode)
        if rc != 0:
            raise RuntimeError(f"native gemv failed with code {rc}")
        return out

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
        fn = self._decode.get((q.dtype, dim)) or self._decode[(q.dtype, None)]
        rc = fn(
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
                _cached = NativeKernels(_build())
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("native CPU kernels unavailable, using torch ops: %s", exc)
                _cached = None
        return _cached
