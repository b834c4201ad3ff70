"""How many tokens a rank's KV pool holds: the rule, pure, and what the weights take.

A rank's pool is, in order of precedence:

1. ``--max-total-tokens``, as given (the whole server's ranks hold that many tokens each DP rank).
2. On CUDA, SGLang's per-device rule: ``mem_fraction_static`` (0.25 if not given) of the device's
   memory free before the weights loaded covers the weights and the pages; each device is its own.
3. On CPU with ``--mem-fraction-static F``: one budget, ``F`` of the host's memory (MemTotal, or the
   cgroup's limit where lower), for the whole server: split evenly over its scheduler ranks (DP x TP
   on this node), each rank's share less the weights that rank allocated. ``pdserve launch`` gives
   each server it starts its part of one budget this way.
4. On CPU without it (servers started separately, whose budget no one process can know): a fixed
   ``DEFAULT_POOL_CONTEXTS`` full contexts of the model (SmolLM2-135M: 4 x 8192 = 32768 tokens,
   0.75 GB in bf16 over all TP ranks).

Rules 2-4 never hold more than ``max_running_requests`` full contexts. None of them reads what
other processes do while this one starts: the host's total (not what is free), and this process's
own tensors as the weights (``tensor_bytes``), packed copies included, not a host-wide difference
of free memory (which counts every other process's allocations meanwhile as this one's weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_POOL_CONTEXTS = 4  # CPU pool without a budget: this many full-context sequences
CUDA_DEFAULT_FRACTION = 0.25  # mem_fraction_static on CUDA when not given
GIB = 2**30


@dataclass(frozen=True)
class PoolSize:
    """A rank's pool in tokens, and the sentence the server logs: how it was chosen, how to change it."""

    tokens: int
    rule: str

    def num_pages(self, page_size: int) -> int:
        """The pool's pages of ``page_size`` tokens, the reserved scratch page 0 included."""
        return self.tokens // page_size + 1


def size_pool(*, max_total_tokens: int | None, mem_fraction_static: float | None, device_type: str,
              per_token_bytes: int, weights_bytes: int, max_context_len: int, max_running_requests: int,
              page_size: int, ranks: int = 1, host_bytes: int | None = None,
              device_free_at_start: int | None = None, device_free_now: int | None = None) -> PoolSize:
    """The rule of the module docstring. ``per_token_bytes``/``weights_bytes``: this rank's;
    ``ranks``: the scheduler ranks of this server on this host, which share a CPU budget;
    ``host_bytes``: the host's memory (CPU with a fraction); ``device_free_*``: CUDA's free memory
    before and after the weights loaded. Raises ValueError when a budget leaves no page."""
    if max_total_tokens is not None:
        return PoolSize(max_total_tokens, "set by --max-total-tokens")
    cap = max_running_requests * max_context_len
    change = "change it with --max-total-tokens or --mem-fraction-static"
    if device_type == "cuda":
        fraction = CUDA_DEFAULT_FRACTION if mem_fraction_static is None else mem_fraction_static
        if device_free_at_start is None or device_free_now is None:
            raise ValueError("CUDA sizing needs the device's free memory before and after the weights")
        weights = max(device_free_at_start - device_free_now, 0)  # the device is this rank's alone
        budget = int(device_free_at_start * fraction) - weights
        where = (f"mem_fraction_static {fraction} of the {device_free_at_start / GIB:.1f} GiB free on the device "
                 f"at start, less the weights' {weights / GIB:.2f} GiB")
    elif mem_fraction_static is not None:
        if host_bytes is None:
            raise ValueError("CPU sizing from mem_fraction_static needs the host's memory")
        budget = int(host_bytes * mem_fraction_static) // ranks - weights_bytes
        where = (f"--mem-fraction-static {mem_fraction_static} of the host's {host_bytes / GIB:.1f} GiB, split over "
                 f"the server's {ranks} rank(s), less this rank's weights ({weights_bytes / GIB:.2f} GiB)")
    else:
        tokens = min(DEFAULT_POOL_CONTEXTS * max_context_len, cap)
        return PoolSize(tokens, f"the CPU default of {DEFAULT_POOL_CONTEXTS} full contexts of "
                                f"{max_context_len} tokens (no memory budget given); {change}")
    if budget < per_token_bytes * page_size:
        raise ValueError(f"{where} leaves no room for KV pages: raise mem_fraction_static or set max_total_tokens")
    return PoolSize(min(budget // per_token_bytes, cap), f"{where}; {change}")


def tensor_bytes(root: object) -> int:
    """Bytes of the tensors reachable from ``root`` (attributes, slots, lists, tuples, dicts), each
    storage counted once: what a model object allocated, its packed copies and scratch included."""
    seen_objs: set[int] = set()
    seen_storage: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objs or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen_objs.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += _storage_bytes(obj, seen_storage)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            if isinstance(obj, torch.nn.Module):
                stack.extend(obj.parameters())
                stack.extend(obj.buffers())
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if isinstance(name, str) and hasattr(obj, name):
                        stack.append(getattr(obj, name))
    return total


def _storage_bytes(t: torch.Tensor, seen: set[int]) -> int:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN's prepacked weights)
        return t.numel() * t.element_size()
    key = storage.data_ptr()
    if key in seen or storage.nbytes() == 0:
        return 0
    seen.add(key)
    return storage.nbytes()
