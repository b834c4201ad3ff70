"""Give host memory back to the OS: the CPU form of SGLang's ``torch_memory_saver``.

``discard_pages(t)`` keeps a tensor's address but drops its physical pages
(``madvise(MADV_DONTNEED)`` on private anonymous memory): RSS falls at once, and
the pages read as zeros when next touched. That is what the KV pool needs on
release: its buffers stay registered with the transfer engine (Mooncake and
NIXL hold their addresses; a decode peer caches them per pair), so they must
come back at the same address, as torch_memory_saver's CUDA virtual-memory
remapping keeps them in SGLang.

``trim_heap()`` returns the free parts of glibc's heap after tensors were
freed: tensors below glibc's mmap threshold (raised to 32 MiB once a mapped
block is freed) live in the heap, and freeing them lowers RSS only after a trim.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

MADV_DONTNEED = 4  # <sys/mman.h>, Linux
OS_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def discard_pages(t: torch.Tensor) -> int:
    """Drop the physical pages wholly inside ``t``'s bytes (a CPU tensor); returns the bytes dropped.
    The partial OS pages at either end stay (they may hold a neighbour's bytes)."""
    if t.device.type != "cpu":
        raise ValueError(f"discard_pages needs a CPU tensor, got one on {t.device}")
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // OS_PAGE) * OS_PAGE
    hi = end // OS_PAGE * OS_PAGE
    if hi <= lo:
        return 0
    if _libc.madvise(lo, hi - lo, MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) failed: {os.strerror(err)}")
    return hi - lo


def trim_heap() -> None:
    """glibc's malloc_trim(0): unmap the heap's free pages (a no-op elsewhere)."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def host_memory_bytes() -> int:
    """The memory this host gives its processes: MemTotal, or the cgroup's limit where that is lower
    (a container). Constant while servers start, unlike what is free."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
        break
    return total
