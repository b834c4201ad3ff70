"""The KV pool's size rule (``model_executor/pool_sizing.py``), pure: which rule applies, a CPU
budget split over a server's ranks, the fixed default when no budget is known, CUDA's per-device
rule, and the weights as this process's own tensors. Nothing here reads free memory."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_executor.pool_sizing import (CUDA_DEFAULT_FRACTION, DEFAULT_POOL_CONTEXTS, size_pool,
                                                       tensor_bytes)

GIB = 2**30
BASE = dict(max_total_tokens=None, mem_fraction_static=None, device_type="cpu", per_token_bytes=23040,
            weights_bytes=GIB // 4, max_context_len=8192, max_running_requests=256, page_size=16)


def test_max_total_tokens_wins():
    size = size_pool(**{**BASE, "max_total_tokens": 4096, "mem_fraction_static": 0.5}, host_bytes=24 * GIB)
    assert size.tokens == 4096 and "--max-total-tokens" in size.rule


def test_cpu_without_a_budget_takes_a_fixed_number_of_contexts_whatever_the_host():
    a = size_pool(**BASE, host_bytes=24 * GIB)
    b = size_pool(**{**BASE, "weights_bytes": 6 * GIB}, host_bytes=1 * GIB, ranks=3)
    assert a.tokens == b.tokens == DEFAULT_POOL_CONTEXTS * 8192
    assert "--max-total-tokens" in a.rule and "--mem-fraction-static" in a.rule  # says how to change it
    capped = size_pool(**{**BASE, "max_running_requests": 2})
    assert capped.tokens == 2 * 8192


def test_a_cpu_budget_is_split_over_the_servers_ranks():
    one = size_pool(**{**BASE, "mem_fraction_static": 0.5}, host_bytes=24 * GIB, ranks=1)
    three = size_pool(**{**BASE, "mem_fraction_static": 0.5, "per_token_bytes": 23040 // 3,
                         "weights_bytes": GIB // 12}, host_bytes=24 * GIB, ranks=3)
    assert one.tokens == min((12 * GIB - GIB // 4) // 23040, 256 * 8192)
    assert three.tokens == min((4 * GIB - GIB // 12) // (23040 // 3), 256 * 8192)
    # the three ranks' bytes together stay within the one budget
    assert 3 * (three.tokens * (23040 // 3) + GIB // 12) <= 12 * GIB


def test_a_budget_the_weights_fill_is_an_error_naming_the_flags():
    with pytest.raises(ValueError, match="leaves no room for KV pages: raise mem_fraction_static or set max_total_tokens"):
        size_pool(**{**BASE, "mem_fraction_static": 0.1, "weights_bytes": 3 * GIB}, host_bytes=24 * GIB, ranks=1)


def test_cuda_keeps_the_per_device_rule():
    size = size_pool(**{**BASE, "device_type": "cuda"}, device_free_at_start=80 * GIB, device_free_now=79 * GIB)
    assert size.tokens == min((int(80 * GIB * CUDA_DEFAULT_FRACTION) - GIB) // 23040, 256 * 8192)
    size = size_pool(**{**BASE, "device_type": "cuda", "mem_fraction_static": 0.5, "max_running_requests": 10**6},
                     device_free_at_start=80 * GIB, device_free_now=70 * GIB)
    assert size.tokens == (40 * GIB - 10 * GIB) // 23040


class _Packed:
    __slots__ = ("panels", "scale")

    def __init__(self, w):
        self.panels = w.clone()
        self.scale = torch.ones(7)


def test_tensor_bytes_counts_each_storage_once_packed_copies_included():
    w = torch.zeros(100, 10)
    model = type("M", (), {})()
    model.w = w
    model.view = w[:50]  # a view of w: no new bytes
    model.layers = [{"a": torch.zeros(5, dtype=torch.bfloat16)}, (_Packed(w),)]
    model.mod = torch.nn.Linear(4, 3, bias=False)
    model.me = model  # cycles end
    assert tensor_bytes(model) == 100 * 10 * 4 + 5 * 2 + 100 * 10 * 4 + 7 * 4 + 12 * 4
