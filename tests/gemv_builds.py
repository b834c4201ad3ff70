"""The native kernels once per gemv instruction set this CPU can run, for the gemv tests: the
build for this CPU and, where that one is AVX-512's, a build for ``x86-64-v3`` (AVX2 and FMA), so
that a machine with AVX-512 tests the AVX2 kernels too."""

from __future__ import annotations

import pytest

from pdserve.kernels.cpu_native import kernels_for, native_kernels


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def gemv_builds() -> list:
    """pytest params, one NativeKernels each with ids ``avx512`` / ``avx2``; empty without gemv."""
    native = native_kernels()
    if native is None or not native.has_gemv:
        return []
    builds = [pytest.param(native, id=native.gemv_isa)]
    if native.gemv_isa != "avx2" and {"avx2", "fma"} <= _cpu_flags():
        avx2 = kernels_for("x86-64-v3")
        assert avx2.gemv_isa == "avx2"
        builds.append(pytest.param(avx2, id="avx2"))
    return builds
