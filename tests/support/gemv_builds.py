"""The native kernels once per gemv instruction set this CPU can run, for the gemv tests: the
build for this CPU and, where that one is AVX-512's, a build for ``x86-64-v3`` (AVX2 and FMA), so
that a machine with AVX-512 tests the AVX2 kernels too."""

from __future__ import annotations

import pytest

from pdserve.kernels.cpu_native import cpu_flags, kernels_for, native_kernels


def gemv_builds() -> list:
    """pytest params, one NativeKernels each with ids ``avx512`` / ``avx2``; empty without gemv."""
    native = native_kernels()
    if native is None or not native.has_gemv:
        return []
    builds = [pytest.param(native, id=native.gemv_isa)]
    if native.gemv_isa != "avx2" and {"avx2", "fma"} <= cpu_flags():
        avx2 = kernels_for("x86-64-v3")
        assert avx2.gemv_isa == "avx2"
        builds.append(pytest.param(avx2, id="avx2"))
    return builds
