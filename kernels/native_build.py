"""Compiling the native CPU kernels: the C sources (package data next to this file) built with
the system compiler into one shared library, which ``cpu_native.py`` binds through ctypes.

They carry no torch headers, so they compile in well under a second with
``cc -O3 -march=native -fopenmp`` into one library (``build_library``), cached under
``~/.cache/pdserve/kernels`` keyed by sources, flags and CPU. It links the
``libgomp.so.1`` that torch has already loaded, so it shares torch's OpenMP
threads (and ``torch.set_num_threads``). Where no compiler is found or the
build fails, ``native_kernels()`` returns None and callers use the torch path.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import shutil
import subprocess
import tempfile

# the C sources, package data next to this file; the .c files are the translation units
_SOURCES = ("cpu_common.h", "cpu_bf16_avx512.h", "cpu_amx.h", "cpu_gemv_avx512.h", "cpu_gemv_avx2.h",
            "cpu_decode_attn.c", "cpu_prefill_attn.c", "cpu_norm_rope.c", "cpu_gemv.c", "cpu_decode_layer.c",
            "cpu_int8_act.c", "cpu_amx_int8.c", "cpu_gemm.c", "cpu_kv_store.c", "cpu_argmax.c",
            "cpu_moe.c", "cpu_mla_decode.c", "cpu_lora.h", "cpu_lora.c")

# Reassociation lets the dot products and sums vectorize (~1.7x here). Not -ffast-math: with
# gcc < 13 it links crtfastmath into a shared library, which turns on flush-to-zero process-wide.
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]


def _cpu_signature() -> str:
    """/proc/cpuinfo's flags line (``Features`` on Arm), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (``avx2``, ``avx512_bf16``, ...)."""
    line = _cpu_signature()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _read_sources() -> dict[str, str]:
    package = importlib.resources.files(__package__)
    return {name: (package / name).read_text() for name in _SOURCES}


def build_library(march: str = "native") -> str:
    """The library for ``-march=march`` (``native``: this CPU's instruction sets), built or cached."""
    flags = [f"-march={march}", *_FLAGS]
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    sources = _read_sources()
    key_parts = [text for name in _SOURCES for text in (name, sources[name])]
    key = hashlib.sha256("\0".join([*key_parts, *flags, compiler, _cpu_signature()]).encode()).hexdigest()[:16]
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
        proc = subprocess.run([compiler, *flags, *units, "-o", out, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[:2000]}")
        os.replace(out, lib_path)  # atomic: concurrent builders race harmlessly
    return lib_path
